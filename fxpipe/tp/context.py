"""The one "current TP group" mechanism: a context variable set by whoever runs a graph.

A tensor-parallel graph is the same on every TP rank (SPMD); what differs is the
group its collective ops talk to, the rank-dependent offsets (vocabulary range,
local heads) and the dropout stream. All of that comes from here::

    with tp_group_context(group, rng):
        loss = program.run(local_state, *batch)
    loss.backward()          # no context needed: backward uses what forward saved
                             # (recomputed regions re-enter it themselves)

Forward ops read the context; autograd nodes store the group on ``ctx`` during
forward, so backward never depends on the context (on GPU, or with a pipeline
executor, backward may run on another thread). There is deliberately no global
fallback: running a TP graph outside a context is an error that names the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ContextManager

import torch

from fxpipe.base.current import CurrentValue
from fxpipe.tp.group import TPGroup

# Megatron-LM seeds its tensor-parallel RNG stream with seed + 2718 + tp_rank
# (megatron/core/tensor_parallel/random.py, model_parallel_cuda_manual_seed).
_TP_SEED_OFFSET = 2718


class DropoutRNG:
    """Megatron's RNG tracker, reduced to the two streams TP needs.

    - ``replicated``: the same seed on every TP rank. Dropout on a replicated
      activation (after an all-reduce) must draw the same mask on every rank, or
      the replicas drift apart.
    - ``sharded``: seed + 2718 + tp_rank. Dropout inside a sharded region (heads,
      FFN channels, sequence shards) must draw a different mask on every rank.

    Generators are created lazily per device. Keep one ``DropoutRNG`` per rank
    for the whole run (a fresh one per step would repeat the masks)."""

    def __init__(self, seed: int, tp_rank: int) -> None:
        self.seed = seed
        self.tp_rank = tp_rank
        self._generators: dict[tuple[str, bool], torch.Generator] = {}

    def generator(self, device: torch.device, sharded: bool) -> torch.Generator:
        key = (str(device), sharded)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed + (_TP_SEED_OFFSET + self.tp_rank if sharded else 0))
            self._generators[key] = gen
        return gen

    def get_state(self) -> dict[tuple[str, bool], torch.Tensor]:
        """Generator states, for activation recomputation or checkpoints."""
        return {k: g.get_state() for k, g in self._generators.items()}

    def set_state(self, state: dict[tuple[str, bool], torch.Tensor]) -> None:
        for (device, sharded), s in state.items():
            self.generator(torch.device(device), sharded).set_state(s)

    def restore(self, state: dict[tuple[str, bool], torch.Tensor]) -> None:
        """Exactly the streams of ``state``: a generator created after it was taken is
        dropped, so it is re-created from its seed and draws the same numbers again."""
        for key in list(self._generators):
            if key not in state:
                del self._generators[key]
        self.set_state(state)


@dataclass(frozen=True)
class TPContext:
    group: TPGroup
    rng: DropoutRNG


_CURRENT: CurrentValue[TPContext] = CurrentValue(
    "fxpipe_tp_context", "a tensor-parallel graph op ran outside tp_group_context(...); wrap the call: "
    "`with fxpipe.tp.tp_group_context(group): program.run(state, *batch)`")


def tp_group_context(group: TPGroup, rng: DropoutRNG | None = None) -> ContextManager[TPContext]:
    """Make ``group`` (and ``rng``) current for the TP graph ops run inside the block.

    Without ``rng`` a fresh ``DropoutRNG(seed=0, tp_rank=group.rank)`` is used:
    fine for dropout-free runs and tests; a training loop passes its own."""
    return _CURRENT.scope(TPContext(group, rng if rng is not None else DropoutRNG(0, group.rank)))


def current_tp() -> TPContext:
    """The context set by :func:`tp_group_context`; a clear error outside one."""
    return _CURRENT.get()


def current_tp_or_none() -> TPContext | None:
    """The current context, or None outside any (for code that works with and without TP)."""
    return _CURRENT.get_or_none()
