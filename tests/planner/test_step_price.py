"""The one price (fxpipe/planner/step_price.py): what both the world-N search and
``fxpipe plan`` compose a step from, checked against the ring formulas and the
runtime's own accounting written out here."""
from __future__ import annotations

import pytest

from fxpipe.base.hardware import Collective, get_hardware
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.planner.options import PlannerOptions
from fxpipe.planner.step_price import dp_sync_s, optimizer_step_s, step_s


@pytest.fixture(scope="module")
def hw():
    return get_hardware("a100")


def test_dp_sync_without_overlap_is_the_collectives_themselves(hw):
    nbytes, dp = 3e9, 8
    plain = dp_sync_s(hw, grad_bytes=nbytes, weight_bytes=nbytes / 2, dp=dp, per_node=8, zero=False,
                      backward_s=1.0, bucket_mb=0.0)
    assert plain == pytest.approx(hw.collective_s(Collective.ALL_REDUCE, nbytes, dp, 8))
    zero = dp_sync_s(hw, grad_bytes=nbytes, weight_bytes=nbytes / 2, dp=dp, per_node=8, zero=True,
                     backward_s=1.0, bucket_mb=0.0)
    assert zero == pytest.approx(hw.collective_s(Collective.REDUCE_SCATTER, nbytes, dp, 8)
                                 + hw.collective_s(Collective.ALL_GATHER, nbytes / 2, dp, 8))
    hidden = dp_sync_s(hw, grad_bytes=nbytes, weight_bytes=nbytes / 2, dp=dp, per_node=8, zero=True,
                       backward_s=1.0, bucket_mb=0.0, gather_hidden_s=1e9)
    assert hidden == pytest.approx(hw.collective_s(Collective.REDUCE_SCATTER, nbytes, dp, 8))
    assert dp_sync_s(hw, grad_bytes=nbytes, weight_bytes=nbytes, dp=1, per_node=1, zero=True, backward_s=0.0) == 0


def test_zero1_on_gloo_is_priced_as_the_all_reduce_the_runtime_runs():
    """runtime/grad_buckets.py all-reduces ZeRO-1's buckets on gloo (its reduce onto one
    rank is slower): the cpu preset says gloo, and its ZeRO-1 reduction costs what plain
    dp's does; a profile naming another backend is refused (profiles are untrusted)."""
    import dataclasses

    from fxpipe.base.hardware import Hardware

    cpu = get_hardware("cpu")
    assert cpu.backend == "gloo" and get_hardware("h100").backend == "nccl"
    kw = dict(grad_bytes=1e8, weight_bytes=0.0, dp=2, per_node=2, backward_s=0.0, bucket_mb=0.0, gather_hidden_s=1e9)
    assert dp_sync_s(cpu, zero=True, **kw) == pytest.approx(dp_sync_s(cpu, zero=False, **kw))
    nccl = dataclasses.replace(cpu, backend="nccl")
    assert dp_sync_s(nccl, zero=True, **kw) == pytest.approx(dp_sync_s(nccl, zero=False, **kw) / 2)
    with pytest.raises(ValueError, match="backend must be one of nccl, gloo"):
        Hardware.from_dict({**cpu.to_dict(), "backend": "mpi"})


def test_dp_sync_behind_the_backward_exposes_at_least_the_last_bucket(hw):
    nbytes, dp, bucket = 4e9, 8, 25.0
    full = hw.collective_s(Collective.ALL_REDUCE, nbytes, dp, 8)
    n = -(-nbytes // (bucket * 2**20))
    last = hw.collective_s(Collective.ALL_REDUCE, nbytes / n, dp, 8)
    for backward in (0.0, full / 2, 10 * full):
        got = dp_sync_s(hw, grad_bytes=nbytes, weight_bytes=0, dp=dp, per_node=8, zero=False,
                        backward_s=backward, bucket_mb=bucket)
        assert last - 1e-12 <= got <= n * last + 1e-12  # each bucket its own ring


def test_optimizer_step_is_the_owned_state_over_memory_bandwidth(hw):
    params = 1e9
    assert optimizer_step_s(hw, params, dp=4, zero=False, traffic_bytes=32) == pytest.approx(
        params * 32 / hw.memory_bw + 4 * hw.op_overhead_s)
    assert optimizer_step_s(hw, params, dp=4, zero=True, traffic_bytes=32) == pytest.approx(
        params / 4 * 32 / hw.memory_bw + 4 * hw.op_overhead_s)


def test_the_step_is_the_latest_rank_with_its_sync_and_optimizer():
    assert step_s((5.0, 6.0), (2.0, 0.5), (0.1, 0.1)) == (pytest.approx(7.1), 0)
    assert step_s((5.0, 6.0), (0.0, 0.5), (0.1, 0.1), lookup=1.0) == (pytest.approx(7.6), 1)


def test_both_planners_count_training_state_alike():
    # The runtime's fp32 Adam: weight 4 + gradient 4 + moments 8 bytes, the moments 1/dp each under ZeRO-1.
    for dp, zero in ((1, 0), (4, 0), (4, 1), (1, 1)):
        config = ParallelConfig(dp=dp, zero=zero)
        moments = 8 / dp if zero else 8
        assert config.state_bytes_per_param_byte * 4 == pytest.approx(4 + 4 + moments)
    # Megatron's mixed precision: bf16 weight 2, fp32 gradient 4, master + moments 12 (÷d with ZeRO-1).
    assert PlannerOptions().state_bytes(1, 8) == pytest.approx((2, 4, 12 / 8))
    assert PlannerOptions().state_bytes(0, 8) == pytest.approx((2, 4, 12))
