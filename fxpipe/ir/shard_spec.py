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

Pipeline stages may own rows too (``PipelineRows``: vocabulary parallelism across
stages, Yeung et al., MLSys 2025, arXiv 2411.05288): the rows of the LM head (and of a
tied embedding) that a pipeline rank's stages read. ``compose`` folds a pipeline
rank's rows into the tensor-parallel spec, so one ``ShardSpec`` per rank still says
what it holds, and everything that reads specs (shard building, weights, init,
checkpoint chunks) works unchanged for either split or both.
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
    ROWS = "rows"
    """Rows split over pipeline ranks only (``PipelineRows``, composed with no TP split)."""
    EXPERTS = "experts"
    """Stacked experts (dim 0) split over the expert-parallel ranks (``passes/expert_parallel.py``):
    ``ranges`` are per expert-parallel rank, not per TP rank."""
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


@dataclass(frozen=True)
class PipelineRows:
    """The rows (dim 0) of one parameter that each pipeline rank holds.

    Written by ``passes/vocab_rows.py`` when the stages of a rank read a parameter only
    through row slices (the blocks of a split LM head); every stage graph of that rank
    indexes the rank's rows. Row numbers are those of the tensor-parallel local tensor
    (what the graphs index; the full tensor without TP). A rank whose stages read the
    whole tensor (a tied embedding lookup) holds every row; one whose stages do not
    read it holds none."""
    name: str
    """Canonical name of the parameter."""
    rows: int
    """Length of dim 0 of the (tensor-parallel local) tensor."""
    ranks: tuple[Ranges, ...]
    """Per pipeline rank, the ``(start, stop)`` ranges it holds, in order."""

    def positions(self, pp_rank: int) -> list[int]:
        return [i for a, b in self.ranks[pp_rank] for i in range(a, b)]

    def local_rows(self, pp_rank: int) -> int:
        return sum(b - a for a, b in self.ranks[pp_rank])

    def segments(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(start, stop, pipeline ranks holding it) for every maximal run of rows held
        by the same ranks: what the tied-gradient sum reduces, range by range."""
        cuts = sorted({0, self.rows, *(x for r in self.ranks for ab in r for x in ab)})
        out: list[tuple[int, int, tuple[int, ...]]] = []
        for a, b in zip(cuts, cuts[1:]):
            holders = tuple(p for p, r in enumerate(self.ranks) if any(x <= a and b <= y for x, y in r))
            if out and out[-1][2] == holders and out[-1][1] == a:
                out[-1] = (out[-1][0], b, holders)
            else:
                out.append((a, b, holders))
        return [seg for seg in out if seg[2]]

    def offset(self, pp_rank: int, row: int) -> int:
        """Position of ``row`` in ``pp_rank``'s local tensor."""
        pos = 0
        for a, b in self.ranks[pp_rank]:
            if a <= row < b:
                return pos + row - a
            pos += b - a
        raise AssertionError(f"pipeline rank {pp_rank} does not hold row {row} of {self.name}")


def compose(spec: ShardSpec | None, rows: PipelineRows, pp_rank: int,
            full_shape: tuple[int, ...]) -> ShardSpec:
    """The ``ShardSpec`` of what pipeline rank ``pp_rank`` holds of ``rows.name``: its
    pipeline rows of each tensor-parallel rank's shard (``full_shape``: the model's
    shape). Padding rows of a vocabulary shard stay last, as ``shard_tensor`` expects."""
    positions = rows.positions(pp_rank)
    local = (len(positions), *full_shape[1:])
    if spec is None or spec.kind is ShardKind.REPLICATED:
        return ShardSpec(name=rows.name, kind=ShardKind.ROWS, full_shape=tuple(full_shape), local_shape=local,
                         dim=0, ranges=(ranges_of(positions),), members=spec.members if spec else (),
                         reason=f"pipeline rows {ranges_of(positions)}")
    assert spec.dim == 0, f"{spec.name}: pipeline rows compose with a dim-0 shard only"
    per_tp = []
    for t in range(spec.tp):
        held = spec.indices(t)
        per_tp.append(ranges_of([held[p] for p in positions if p < len(held)]))
    return ShardSpec(name=spec.name, kind=spec.kind, full_shape=spec.full_shape, local_shape=local, dim=0,
                     ranges=tuple(per_tp), members=spec.members,
                     reason=f"{spec.reason}; pipeline rows {ranges_of(positions)}")


def rank_specs(specs: Mapping[str, ShardSpec], rows: Mapping[str, PipelineRows], pp_rank: int,
               full_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, ShardSpec]:
    """Every parameter's spec on pipeline rank ``pp_rank``: the tensor-parallel specs with
    the rank's pipeline rows folded in (``compose``); a rank holding none of a
    parameter's rows keeps the TP spec (it holds no tensor of it)."""
    out = dict(specs)
    for name, r in rows.items():
        if r.ranks[pp_rank]:
            out[name] = compose(specs.get(name), r, pp_rank, full_shapes[name])
    return out


def expert_rank_spec(spec: ShardSpec, ep_rank: int) -> ShardSpec:
    """What expert-parallel rank ``ep_rank`` holds of a stacked expert weight, as a
    one-rank spec (read with rank 0, as ``compose`` makes them): its experts' range of
    dim 0. Weights, init replay and the fp32 masters then build just those experts."""
    assert spec.kind is ShardKind.EXPERTS, spec
    return ShardSpec(name=spec.name, kind=spec.kind, full_shape=spec.full_shape, local_shape=spec.local_shape,
                     dim=0, ranges=(spec.ranges[ep_rank],), members=spec.members,
                     reason=f"{spec.reason}; expert-parallel rank {ep_rank}")
