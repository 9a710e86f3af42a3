"""``NodeCost``: what one graph node costs from its shapes alone, the record the hardware
model turns into seconds (kept below the IR so ``base/hardware.py`` can read it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node from shapes alone (see ``fxpipe.passes.cost``)."""
    fwd_flops: int
    """Matrix-multiply FLOPs of the forward (2·M·N·K), the FLOPs of model-FLOPs formulas."""
    bwd_flops: int
    """Matrix-multiply FLOPs of the backward (input and weight gradients)."""
    other_flops: int
    """Element-wise / reduction FLOPs of the forward (one per output element, roughly)."""
    out_bytes: int
    """Bytes of the node's output tensor(s): what crosses a stage boundary if cut here."""
    mem_bytes: int
    """Bytes the forward reads and writes (inputs + outputs), for a roofline time."""
    param_bytes: int
    """Bytes of parameters this node reads (counted once, at the parameter's first use)."""
