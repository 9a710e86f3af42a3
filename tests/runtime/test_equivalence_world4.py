"""The world of 4, first half (test_equivalence.py says what is checked): pp=4 under
every schedule, dp=2 × pp=2 with bucketed gradient reduction, and tensor parallelism
(with dp, pp, sp) on the three families. The second half (the zoo models, the
wide-vocabulary heads, expert parallelism) is test_equivalence_world4_heads.py: two
modules, so pytest-xdist runs the two worlds on its two workers at once."""
import pytest

from tests.runtime._equivalence import world4_module

CASES, world4, test_world4 = world4_module(0)


@pytest.mark.slow
def test_dp_buckets_reduced_during_the_last_weight_pass(world4):
    """dp=2 × pp=2 under ZB-H1: the buckets' all-reduces start inside each rank's last
    W, not after the step's backward (runtime/grad_buckets.py)."""
    from tests.runtime._zero_cases import launched_in_last_backward

    index = next(i for i, c in enumerate(CASES) if c.get("bucket_mb"))
    for rank_results in world4:
        buckets = rank_results[index]["buckets"]
        launched_in_last_backward(buckets)
        assert len(buckets["launched"]) > 2
