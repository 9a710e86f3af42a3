"""Tensor-parallel shards as DCP chunks: checkpoints without gathering.

A rank hands DCP its own shard of each tensor-parallel parameter (and of the Adam
moments of that shape) as a ``ShardedTensor`` of the *full* shape, one local shard
per index range of its ``ShardSpec`` (ranges may be non-contiguous: GPT-2's fused
``c_attn``; vocabulary padding rows are left out). DCP stores each range as a chunk
at its offset, so the checkpoint's keys and global shapes are the same whatever
layout wrote it, and a loading rank of any tp asks for its own ranges: DCP reads the
overlapping parts of whatever chunks were saved (``create_default_local_load_plan``).
No rank ever materialises a full tensor of a sharded parameter, saving or loading.

DTensor cannot express non-contiguous placements; DCP's chunk model can, and
``ShardedTensor`` is the DCP-supported container for an arbitrary list of chunks.
Data-parallel replicas and tied copies offer identical chunks under identical
(key, offset) indexes, and DCP's default planner writes each once
(``_dedup_save_plans``).

Rows split over pipeline ranks (``sharding.PipelineRows``) are chunks the same way:
the rank's spec has its rows folded in (``sharding.compose``). Rows that several
pipeline ranks hold (a tied table on the first stage, head rows on the last) would be
chunks of different extents over the same rows, which DCP refuses as overlapping, so
each row is written by the lowest pipeline rank holding it (``first_held``).

Expert-parallel stacks are chunks the same way: an expert rank's spec holds its
experts' range of dim 0 (``sharding.expert_rank_spec``), the other experts' ranges are
fillers, and the replicas of one expert rank offer identical chunks (written once).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from fxpipe.ir.shard_spec import PipelineRows, ShardKind, ShardSpec, ranges_of

# torch marks ShardedTensor as deprecated in favour of DTensor, which cannot express
# non-contiguous ranges (above); DCP still saves and reshards it. Silence that one note.
warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)


def is_sharded(spec: ShardSpec | None) -> bool:
    return spec is not None and spec.kind is not ShardKind.REPLICATED


def _offsets(spec: ShardSpec, start: int) -> list[int]:
    return [start if d == spec.dim else 0 for d in range(len(spec.full_shape))]


def _sizes(spec: ShardSpec, length: int) -> list[int]:
    return [length if d == spec.dim else s for d, s in enumerate(spec.full_shape)]


def _global_metadata(spec: ShardSpec, tp_global_ranks: list[int], dtype: torch.dtype,
                     device: torch.device) -> ShardedTensorMetadata:
    """Every tp rank's ranges, placed on that rank's global rank (ShardedTensor's
    placements name global ranks). Where they do not tile the tensor (a pipeline rank's
    rows: the other rows live on other pipeline ranks) the rest is one filler shard per
    gap placed on another rank: ShardedTensor insists on a tiling, while DCP reads and
    writes only this rank's local shards, so the fillers never touch the checkpoint."""
    dev = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
    shards = [ShardMetadata(shard_offsets=_offsets(spec, a), shard_sizes=_sizes(spec, b - a),
                            placement=f"rank:{g}/{dev}")
              for t, g in enumerate(tp_global_ranks) for a, b in spec.ranges[t]]
    assert spec.dim is not None
    held = sorted((a, b) for r in spec.ranges for a, b in r)
    gaps, at = [], 0
    for a, b in held + [(spec.full_shape[spec.dim], spec.full_shape[spec.dim])]:
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    other = (dist.get_rank() + 1) % dist.get_world_size() if gaps else None
    shards += [ShardMetadata(shard_offsets=_offsets(spec, a), shard_sizes=_sizes(spec, b - a),
                             placement=f"rank:{other}/{dev}") for a, b in gaps]
    return ShardedTensorMetadata(shards_metadata=shards, size=torch.Size(spec.full_shape),
                                 tensor_properties=TensorProperties(dtype=dtype))


def as_chunks(local: torch.Tensor, spec: ShardSpec, tp_rank: int, tp_global_ranks: list[int],
              group) -> ShardedTensor:
    """This rank's shard ``local`` (ranges in order, then padding) as a ShardedTensor of
    the full shape. The local shards are views of ``local`` where they are contiguous
    (ranges along dim 0); ShardedTensor takes contiguous shards only, so a range along a
    later dim (GPT-2's Conv1D c_attn split by columns) is a copy (``fill_from_shards``
    writes a loaded copy back)."""
    assert spec.dim is not None
    global_md = _global_metadata(spec, tp_global_ranks, local.dtype, local.device)
    mine = [md for md in global_md.shards_metadata if md.placement.rank() == tp_global_ranks[tp_rank]]
    if len(global_md.shards_metadata) > sum(len(r) for r in spec.ranges):
        group = None  # fillers sit on ranks outside the tp group: placements are checked against the world
    shards, offset = [], 0
    for md, (a, b) in zip(mine, spec.ranges[tp_rank]):
        piece = local.narrow(spec.dim, offset, b - a)
        shards.append(Shard(tensor=piece if piece.is_contiguous() else piece.contiguous(), metadata=md))
        offset += b - a
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_md, process_group=group)


def empty_chunks(spec: ShardSpec, tp_rank: int, tp_global_ranks: list[int], group,
                 dtype: torch.dtype) -> tuple[ShardedTensor, Callable[[], torch.Tensor]]:
    """A load target for this rank's ranges (on CPU, in the checkpoint's dtype) and a
    function returning the local tensor after ``dcp.load``: this rank's shard with zero
    padding rows, exactly what ``shard_state`` cuts from a full tensor."""
    local = torch.zeros(spec.local_shape, dtype=dtype)
    sharded = as_chunks(local, spec, tp_rank, tp_global_ranks, group)
    return sharded, lambda: fill_from_shards(local, sharded, spec, tp_rank)


def fill_from_shards(local: torch.Tensor, sharded: ShardedTensor, spec: ShardSpec, tp_rank: int) -> torch.Tensor:
    """``local`` with the shards ``as_chunks`` had to copy (not views of it) written back."""
    assert spec.dim is not None
    offset = 0
    for shard, (a, b) in zip(sharded.local_shards(), spec.ranges[tp_rank]):
        view = local.narrow(spec.dim, offset, b - a)
        if shard.tensor.data_ptr() != view.data_ptr():
            view.copy_(shard.tensor)
        offset += b - a
    return local


def wrap_state(tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec], tp_rank: int,
               tp_global_ranks: list[int], group) -> dict[str, torch.Tensor | ShardedTensor]:
    """Sharded entries (whose shape is the spec's local shape) as ShardedTensors; the
    rest (replicated tensors, scalars such as Adam's ``step``) as they are."""
    out: dict[str, torch.Tensor | ShardedTensor] = {}
    for name, t in tensors.items():
        spec = specs.get(name)
        if is_sharded(spec) and tuple(t.shape) == tuple(spec.local_shape):
            out[name] = as_chunks(t.detach(), spec, tp_rank, tp_global_ranks, group)
        else:
            out[name] = t
    return out


def first_held(rows: PipelineRows, pp_rank: int) -> list[int]:
    """Local rows of ``pp_rank`` that no lower pipeline rank holds: what it writes."""
    lower = {i for p in range(pp_rank) for i in rows.positions(p)}
    return [j for j, i in enumerate(rows.positions(pp_rank)) if i not in lower]


def restrict(spec: ShardSpec, keep: list[int]) -> ShardSpec:
    """``spec`` for the local rows ``keep`` only (in order) of a dim-0 shard."""
    assert spec.dim == 0 and keep
    ranges = []
    for t in range(spec.tp):
        held = spec.indices(t)
        ranges.append(ranges_of([held[j] for j in keep if j < len(held)]))
    return dataclasses.replace(spec, local_shape=(len(keep), *spec.local_shape[1:]), ranges=tuple(ranges))
