"""MFU (fxpipe/base/peak_flops.py): the formula against a closed form, and the peaks table."""
from __future__ import annotations

import pytest

from fxpipe.base.peak_flops import device_peak_tflops, mfu


def test_mfu_is_model_flops_per_device_second_over_the_peak():
    # Megatron's GPT FLOPs (REFERENCE.md): 72·B·s·l·h²(1 + s/6h + V/12lh) for one step.
    B, s, l, h, V = 512, 2048, 24, 2048, 51200
    flops = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    # 8 devices at 312 TFLOP/s each taking 10 s: achieved flops/(10·8) per device.
    got = mfu(flops, 10.0, 8, 312.0)
    assert got == pytest.approx(flops / 80 / 312e12, rel=1e-12)
    assert 0.2 < got < 0.6
    with pytest.raises(ValueError, match="positive step time"):
        mfu(flops, 0.0, 8, 312.0)


def test_peak_table_by_device_name_and_precision():
    assert device_peak_tflops("NVIDIA H200", half=True, tf32=False) == 989.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", half=False, tf32=True) == 156.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", half=False, tf32=False) == 19.5
    assert device_peak_tflops("Some CPU", half=True, tf32=False) is None
