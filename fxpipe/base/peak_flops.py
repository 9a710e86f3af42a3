"""Model FLOPs utilisation (MFU): the model's FLOP/s per device over the device's peak.

The model FLOPs are the forward and backward of the model as written (recomputation
is not model work: a run that recomputes does the same model FLOPs in more time), as
Megatron, PaLM and torchtitan count them. The peak is the datasheet's dense figure for
the precision the matrices run in: bf16/fp16 tensor cores; for fp32, TF32 tensor cores
where torch lets matmuls use them, else plain fp32. A device not in the table has no
MFU unless ``--peak-tflops`` gives its peak.
"""
from __future__ import annotations

PEAK_TFLOPS: dict[str, tuple[float, float, float]] = {
    # name in torch.cuda.get_device_name(): dense (bf16/fp16, tf32, fp32) TFLOP/s, SXM parts
    "H200": (989.0, 494.5, 66.9),
    "H100": (989.0, 494.5, 66.9),
    "A100": (312.0, 156.0, 19.5),
    "V100": (125.0, 15.7, 15.7),  # no TF32: fp32 matmuls run at the fp32 rate
}


def device_peak_tflops(device_name: str, half: bool, tf32: bool) -> float | None:
    """The table's peak for ``device_name`` (``half``: bf16/fp16 matrices; else fp32,
    with ``tf32`` when torch allows it), or None for a device it does not list."""
    for key, (half_peak, tf32_peak, fp32_peak) in PEAK_TFLOPS.items():
        if key in device_name.upper():
            return half_peak if half else tf32_peak if tf32 else fp32_peak
    return None


def mfu(model_flops_per_step: float, step_s: float, devices: int, peak_tflops: float) -> float:
    """Model FLOPs per second per device over the peak, as a fraction."""
    if step_s <= 0 or devices < 1 or peak_tflops <= 0:
        raise ValueError(f"MFU needs a positive step time, device count and peak, got {step_s}, {devices}, "
                         f"{peak_tflops}")
    return model_flops_per_step / step_s / devices / (peak_tflops * 1e12)
