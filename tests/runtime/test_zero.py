"""ZeRO-1 equals plain data parallelism, holds a 1/dp share of the optimizer state, and
its checkpoints load into other layouts (one spawned world of 4)."""
from __future__ import annotations

import pytest
import torch

from fxpipe.runtime.zero import assign_owners
from tests.runtime._dist import run_world
from tests.runtime import _zero_cases as cases
from tests.runtime._zero_cases import launched_in_last_backward


def test_owners_are_balanced_and_deterministic():
    sizes = {f"p{i}": n for i, n in enumerate([100, 90, 50, 40, 30, 20, 10, 5, 1])}
    owners = assign_owners(sizes, 3)
    assert owners == assign_owners(dict(reversed(list(sizes.items()))), 3), "independent of order"
    loads = [sum(sizes[n] for n, r in owners.items() if r == k) for k in range(3)]
    # Greedy largest-first: within the largest tensor of the ideal share.
    assert max(loads) - min(loads) <= max(sizes.values())
    assert sum(loads) == sum(sizes.values())


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_world(4, cases.world_zero, str(tmp_path_factory.mktemp("zero")))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2pp2", "tp2dp2", "bf16"])
def test_zero1_equals_plain_data_parallel(world4, layout):
    for rank_results in world4:
        plain, zero = rank_results[(layout, 0)], rank_results[(layout, 1)]
        assert zero["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        # Each replica steps only what it owns, with the same values as plain dp.
        for name, t in zero["masters"].items():
            torch.testing.assert_close(t, plain["masters"][name], rtol=1e-6, atol=1e-7)
    if layout != "bf16":
        for name, p in world4[0][(layout, 1)]["params"].items():
            torch.testing.assert_close(p, world4[0][(layout, 0)]["params"][name], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("layout,dp", [("dp2pp2", 2), ("tp2dp2", 2), ("bf16", 2)])
def test_zero1_holds_a_share_of_the_optimizer_state(world4, layout, dp):
    """Over the replicas of one stage, the owned tensors partition the trainable ones,
    and the optimizer state adds up to plain dp's one copy."""
    by_stage: dict[tuple, list[dict]] = {}  # the data-parallel replicas of one (stage, tp rank)
    for r in world4:
        by_stage.setdefault(r[(layout, 1)]["replicas"], []).append(r)
    for replicas in by_stage.values():
        assert len(replicas) == dp
        trainable = replicas[0][(layout, 1)]["trainable"]
        owned = [n for r in replicas for n in r[(layout, 1)]["owned"]]
        assert sorted(owned) == sorted(trainable), "each trainable tensor has exactly one owner"
        plain = replicas[0][(layout, 0)]["state_elems"]
        shares = [r[(layout, 1)]["state_elems"] for r in replicas]
        assert sum(shares) == plain and max(shares) < plain, shares


@pytest.mark.slow
@pytest.mark.parametrize("key", ["resume_plain", "resume_tp2dp2"])
def test_zero1_checkpoint_resumes_in_another_layout(world4, key):
    reference = world4[0][("dp2pp2", 1)]["losses"]
    for rank_results in world4:
        r = rank_results[key]
        assert r["step"] == cases.SAVE_AT
        assert r["losses"] == pytest.approx(reference[cases.SAVE_AT:], rel=1e-6)


@pytest.mark.slow
def test_clipping_over_shards_equals_one_process(world4):
    """--grad-clip: the global norm over tp/pp/dp shards — tied embeddings across pipeline
    ranks, tp-replicated tensors, ZeRO-1 owners — and the clipped gradients equal
    torch.nn.utils.clip_grad_norm_ on one process."""
    results = [r["clip_tp2pp2"] for r in world4]
    results += [r[(layout, zero)]["clip"] for r in world4 for layout in ("dp2pp2", "tp2dp2") for zero in (0, 1)]
    assert len(results) == 20
    for r in results:
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5)
        assert sorted(r["grads"]) == sorted(r["ref"])
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, r["ref"][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2pp2", "tp2dp2", "bf16"])
@pytest.mark.parametrize("zero", [0, 1])
def test_reduction_starts_during_the_last_backward(world4, layout, zero):
    """runtime/grad_buckets.py: the buckets' all-reduce (plain; ZeRO-1 too on gloo, whose
    reduce onto one rank is slower) — of the fp32 masters under bf16 — start inside the
    last B of the step."""
    for rank_results in world4:
        buckets = rank_results[(layout, zero)]["buckets"]
        launched_in_last_backward(buckets)
        assert buckets["onto_owner"] is (zero == 0)  # ZeRO-1 on gloo: all-reduced whole
        if layout != "tp2dp2":  # ~10 KB buckets: several per rank
            assert len(buckets["launched"]) > 2, buckets


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2pp2", "tp2dp2", "bf16"])
def test_each_parameter_is_waited_for_inside_the_first_forward(world4, layout):
    """ZeRO-1's broadcast behind the forward (runtime/param_waits.py): the broadcast
    tensors a stage reads are waited for by that stage's graph during the step's first
    forward, one collective at a time while later ones are still in flight, not all of
    them before the forward starts."""
    for rank_results in world4:
        r = rank_results[(layout, 1)]
        received = [c for c in r["waits"] if c[1] is not None]
        assert received, "this replica receives the tensors it does not own"
        # Waited for by the end of the first forward (a table this rank looks rows up in
        # for another stage just before it), and from inside it.
        first_start, first_end = r["forwards"][0]
        assert all(c[3] <= first_end for c in received)
        assert any(first_start <= c[3] for c in received)
        # At the first tensor received, more collectives than its own were still pending.
        assert received[0][2] > 1
        # In the order the forward reads them: the collectives' indices never go back
        # (the coalesced small tensors' buffers first, one collective for many names).
        indices = [c[1] for c in received]
        assert indices == sorted(indices)
