"""``CheckpointedRegion``: the module a recomputed region runs as, inside a stage graph.

The recompute pass (``passes/recompute.py``) outlines regions into it; the runtime
runs it (eagerly, or inlined by ``runtime/compiled.py`` with partitioner tags). It
lives outside both so that the runtime imports no pass.
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fxpipe.tp.context import TPContext, current_tp_or_none, tp_group_context


class CheckpointedRegion(nn.Module):
    """Runs ``body`` under non-reentrant activation checkpointing.

    Forward saves only the inputs; backward reruns ``body`` with the RNG state of
    the first run (``preserve_rng_state``), so dropout replays the same mask."""

    def __init__(self, body: fx.GraphModule) -> None:
        super().__init__()
        self.body = body

    def forward(self, *args: object) -> tuple:
        tp = current_tp_or_none()
        if tp is None:
            return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True)
        return checkpoint(_TPReplay(self.body, tp), *args, use_reentrant=False, preserve_rng_state=True)


class _TPReplay:
    """The body under tensor parallelism: checkpoint preserves torch's global RNG, not
    the TP dropout streams (Megatron's RNG tracker, which its own checkpoint function
    forks for the same reason), nor the TP group context, which backward may not see.
    The first call runs the body and remembers the streams' state before it; the
    recomputation re-enters the context, rewinds the streams to that state, and puts
    them back afterwards so later dropout draws are unaffected."""

    def __init__(self, body: fx.GraphModule, tp: "TPContext") -> None:
        self.body, self.tp = body, tp
        self.before = tp.rng.get_state()
        self.ran = False

    def __call__(self, *args: object) -> tuple:
        if not self.ran:
            self.ran = True
            return self.body(*args)
        after = self.tp.rng.get_state()
        self.tp.rng.restore(self.before)
        try:
            with tp_group_context(self.tp.group, self.tp.rng):
                return self.body(*args)
        finally:
            self.tp.rng.restore(after)
