"""Mixed precision: 16-bit compute, fp32 masters, fp16 dynamic loss scaling."""
import pytest

from tests.runtime._cases import STEPS, mixed_precision, reference
from tests.runtime._dist import run_world


@pytest.fixture(scope="module")
def results():
    return run_world(2, mixed_precision), reference("gpt-tiny")[0]


@pytest.mark.slow
@pytest.mark.parametrize("precision,dtype", [("bf16", "torch.bfloat16"), ("fp16", "torch.float16")])
def test_16_bit_training_tracks_fp32(results, precision, dtype):
    per_rank, ref_losses = results
    r = per_rank[0][precision]
    assert r["dtypes"] == {dtype}, "activations cross stages in 16 bits"
    assert r["master_dtypes"] == {"torch.float32"}, "the optimizer updates fp32 masters"
    assert r["skipped"] == [False] * STEPS
    # 16-bit rounding only: within 1% of the fp32 run's losses.
    assert r["losses"] == pytest.approx(ref_losses, rel=1e-2)


@pytest.mark.slow
def test_fp16_overflow_skips_steps_and_backs_off(results):
    per_rank, _ = results
    for rank in per_rank:
        r = rank["fp16-overflow"]
        # 2^40 overflows fp16 (max 65504) for every step here: all skipped, nothing moved,
        # and the scale halved once per skipped step, on every rank alike.
        assert r["skipped"] == [True] * STEPS
        assert r["unchanged"]
        assert r["scale"] == 2.0 ** (40 - STEPS)
