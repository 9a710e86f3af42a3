"""A pipeline rank that holds no parameter: its stages compute only parameter-free ops.
It trains, it is told so on that rank alone, and the optimizer form the warning gives
works on every rank (torch's optimizers refuse a flat empty list)."""
import pytest

from tests.runtime._dist import run_world
from tests.runtime._parameterless import reference_losses, train_each_rank


@pytest.mark.slow
def test_a_rank_without_parameters_is_told_how_to_build_its_optimizer_and_trains_exactly():
    ranks = run_world(3, train_each_rank)
    empty = [r for r, got in enumerate(ranks) if not got["names"]]
    assert empty == [1], [got["names"] for got in ranks]  # the middle third: parameter-free blocks only
    for r, got in enumerate(ranks):
        if r in empty:
            (said,) = got["said"]
            assert "rank 1 holds no trainable parameter" in said and "torch.optim.AdamW([{'params'" in said, said
            assert got["flat"] == "optimizer got an empty parameter list"
        else:
            assert got["said"] == [] and got["flat"] == "accepted"
    ref = reference_losses()
    for got in ranks:
        assert got["losses"] == pytest.approx(ref, rel=1e-5), (got["losses"], ref)
