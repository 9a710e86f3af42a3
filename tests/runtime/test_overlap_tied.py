"""runtime/grad_sync.py: the reductions over other groups than data parallel — a tied
copy's sum with the dp average as one all-reduce over its pipeline ranks × the dp
replicas, expert stacks over the replicas of the same experts — are issued during the
backward that finishes them, not after the rank's last backward (gloo worlds).
Their results equal one process's: tests/runtime/test_equivalence.py, test_zero.py."""
import pytest

from tests.runtime._dist import run_world

SHARED = "tests.runtime._shared_weights:workload"  # one Linear applied in both stages
EXPERTS = "tests.runtime._ep_cases:workload"

# (gpt-tiny has no tied group at pp=2: its whole table sits on the head's rank, looked up
# from there by the first stage: passes/vocab_rows.py.)
WORLD2 = [dict(model=SHARED, pp=2, schedule="1f1b"),  # dp=1: the tied sum alone
          dict(model=SHARED, pp=2, schedule="zb-h1")]  # split backward: final after the last W
WORLD4 = [dict(model=SHARED, pp=2, schedule="1f1b", zero=1, precision="bf16"),  # tied × dp=2, ZeRO-1, masters
          dict(model=EXPERTS, pp=1, schedule="1f1b", ep=2)]  # dp=4: experts summed over 2 replicas


def _issued_during_the_backward(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["groups"] > 0, "the case has no tied or expert-replica group"
        assert r["issued"], f"rank {rank}: nothing was reduced over its tied / expert groups"
        late = [t - r["last_backward_end"] for t in r["issued"] if t > r["last_backward_end"]]
        assert not late, (f"rank {rank}: {len(late)} of {len(r['issued'])} reductions issued "
                          f"{1e3 * max(late):.2f} ms after the last backward returned")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD2)), ids=["shared-linear-pp2-1f1b", "shared-linear-pp2-zb-h1"])
def test_tied_sums_start_during_the_backward_world2(world2_issued, index):
    _issued_during_the_backward([rank[index] for rank in world2_issued])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(WORLD4)), ids=["shared-linear-dp2-pp2-zero1-bf16", "experts-dp4-ep2"])
def test_tied_and_expert_sums_start_during_the_backward_world4(world4_issued, index):
    _issued_during_the_backward([rank[index] for rank in world4_issued])


@pytest.fixture(scope="module")
def world2_issued():
    from tests.runtime._overlap_cases import issued_times
    return run_world(2, issued_times, WORLD2)


@pytest.fixture(scope="module")
def world4_issued():
    from tests.runtime._overlap_cases import issued_times
    return run_world(4, issued_times, WORLD4)
