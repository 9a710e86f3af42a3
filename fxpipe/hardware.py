"""Hardware models: turn FLOPs and bytes into seconds.

A deliberately small roofline: a node's time is its matmul FLOPs at the matmul
rate plus its other memory traffic at the memory bandwidth. Efficiencies (the
fraction of peak a real kernel reaches) are part of each preset and documented.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpipe.program import NodeCost


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    matmul_flops: float
    """Achievable dense matmul FLOP/s (peak × efficiency)."""
    memory_bw: float
    """Achievable memory bandwidth, bytes/s (element-wise ops are bound by it)."""
    p2p_bw: float
    """Point-to-point bandwidth between pipeline stages, bytes/s."""
    p2p_latency: float
    """Seconds per point-to-point message."""
    memory_bytes: int
    """Device memory per accelerator."""

    def forward_s(self, c: NodeCost) -> float:
        return c.fwd_flops / self.matmul_flops + (0 if c.fwd_flops else c.mem_bytes / self.memory_bw)

    def backward_s(self, c: NodeCost) -> float:
        # Element-wise backward reads the saved input and the output gradient and
        # writes the input gradient: about twice the forward traffic.
        return c.bwd_flops / self.matmul_flops + (0 if c.fwd_flops else 2 * c.mem_bytes / self.memory_bw)


# A100-80GB as in the SC21 paper: 312 TFLOP/s bf16 peak; ~60% achievable in large
# GEMMs; HBM2e 2.0 TB/s at ~80%; inter-node 8×200 Gb/s InfiniBand per 8 GPUs
# = 25 GB/s per GPU.
A100 = Hardware(name="a100", matmul_flops=312e12 * 0.6, memory_bw=2.0e12 * 0.8,
                p2p_bw=25e9, p2p_latency=10e-6, memory_bytes=80 * 2**30)
# A 2-core CPU over gloo/loopback: rough figures; `fxpipe calibrate` measures them.
CPU = Hardware(name="cpu", matmul_flops=50e9, memory_bw=5e9, p2p_bw=1e9, p2p_latency=50e-6,
               memory_bytes=24 * 2**30)

PRESETS = {h.name: h for h in (A100, CPU)}


def get_hardware(name: str) -> Hardware:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; valid: {', '.join(PRESETS)}") from None
