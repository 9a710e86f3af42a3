"""The shard contract: which slice of every parameter each TP rank holds, and the
two functions that move between a full state dict and per-rank shards.

The tensor-parallel pass writes it (``passes/tensor_parallel/placement.py``); the
runtime, checkpoints, weight loading and deferred initialisation read it. It lives
here, beside ``program.py``, so that neither side imports the other for it.

A spec maps a parameter (by its original name; tied names share one spec) to the
tensor dim it is split along and, per TP rank, the index ranges along that dim,
in order. Ranges may be non-contiguous: GPT-2's fused ``c_attn`` gives rank r
its heads of q, of k and of v, three ranges. Vocabulary shards may end in zero
padding rows (the vocabulary is padded to a multiple of tp, Megatron-style).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch


class ShardKind(enum.Enum):
    COLUMN = "column"
    """Output channels split (Megatron column-parallel: QKV, MLP up/gate)."""
    ROW = "row"
    """Input channels split (Megatron row-parallel: attention output, MLP down)."""
    VOCAB = "vocab"
    """Vocabulary rows split (vocab-parallel embedding and LM head)."""
    REPLICATED = "replicated"
    """Every rank holds the full tensor."""


Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ShardSpec:
    name: str
    """Canonical (original) name of the parameter or buffer."""
    kind: ShardKind
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    """Shape every rank holds (the same on all ranks)."""
    dim: int | None = None
    """Tensor dim that is split; None when replicated."""
    ranges: tuple[Ranges, ...] = ()
    """Per TP rank, the ``(start, stop)`` index ranges along ``dim`` it holds, in order."""
    members: tuple[str, ...] = ()
    """Every name that shares this tensor (tied parameters), canonical first."""
    reason: str = ""
    """Why this placement: the role found, or why the parameter stays replicated."""

    def __post_init__(self) -> None:
        if self.kind is ShardKind.REPLICATED:
            assert self.dim is None and self.local_shape == self.full_shape, self
            return
        assert self.dim is not None and self.ranges, self
        held = {sum(b - a for a, b in r) for r in self.ranges}
        assert all(h <= self.local_shape[self.dim] for h in held), self

    @property
    def tp(self) -> int:
        return len(self.ranges) if self.ranges else 1

    def indices(self, tp_rank: int) -> list[int]:
        """Indices along ``dim`` that ``tp_rank`` holds, in its order."""
        return [i for a, b in self.ranges[tp_rank] for i in range(a, b)]

    def padding(self, tp_rank: int) -> int:
        """Zero rows appended after the held ones (vocabulary padding)."""
        assert self.dim is not None
        return self.local_shape[self.dim] - len(self.indices(tp_rank))

    def describe_ranges(self, tp_rank: int) -> str:
        text = ",".join(f"{a}:{b}" for a, b in self.ranges[tp_rank])
        pad = self.padding(tp_rank)
        return f"[{text}]" + (f"+{pad} pad" if pad else "")


def ranges_of(indices: Sequence[int]) -> Ranges:
    """[0,1,2,5,6] -> ((0,3),(5,7))."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [idx.size]])
    return tuple((int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, stops))


def shard_tensor(t: torch.Tensor, spec: ShardSpec, tp_rank: int) -> torch.Tensor:
    if spec.kind is ShardKind.REPLICATED:
        return t
    assert spec.dim is not None
    parts = [t.narrow(spec.dim, a, b - a) for a, b in spec.ranges[tp_rank]]
    pad = spec.padding(tp_rank)
    if pad:
        shape = list(t.shape)
        shape[spec.dim] = pad
        parts.append(t.new_zeros(shape))
    return torch.cat(parts, dim=spec.dim) if len(parts) > 1 else parts[0].clone()


def shard_state(full_state: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec],
                tp_rank: int) -> dict[str, torch.Tensor]:
    """The state of TP rank ``tp_rank``: sharded entries are new tensors, replicated
    entries are the full tensors themselves (no copy). Keys are canonical names,
    as in ``Program.state``; names without a spec are passed through."""
    out = {}
    for name, t in full_state.items():
        spec = specs.get(name)
        out[name] = t if spec is None else shard_tensor(t, spec, tp_rank)
    return out


def unshard_state(per_rank_states: Sequence[Mapping[str, torch.Tensor]],
                  specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """Rebuild full tensors from every rank's shards (state dicts or gradients).

    Replicated entries are taken from rank 0. Padding rows are dropped."""
    if not per_rank_states:
        raise ValueError("unshard_state needs the states of every TP rank, got none")
    out = {}
    for name, first in per_rank_states[0].items():
        spec = specs.get(name)
        if spec is None or spec.kind is ShardKind.REPLICATED:
            out[name] = first
            continue
        if len(per_rank_states) != spec.tp:
            raise ValueError(f"{name} is sharded over tp={spec.tp} ranks, "
                             f"got {len(per_rank_states)} states")
        assert spec.dim is not None
        full = first.new_empty(spec.full_shape)
        for rank, state in enumerate(per_rank_states):
            offset = 0
            for a, b in spec.ranges[rank]:
                full.narrow(spec.dim, a, b - a).copy_(state[name].narrow(spec.dim, offset, b - a))
                offset += b - a
        out[name] = full
    return out
