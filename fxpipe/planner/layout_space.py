"""The layouts a search chooses among: every layout of a world size for a batch
(``candidate_layouts``), and the same layout holding less memory (``memory_savers``).

The search (``auto_layout.py``) prices what this module enumerates; the fields named here
(``SEARCHED``) are the ones it decides, which ``parallelize``, ``fxpipe run`` and
``fxpipe compile`` accept as pins."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterator, Mapping, Sequence

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.planner.search import divisors
from fxpipe.schedules.registry import ScheduleKind, get_spec

LAYOUT_FIELDS = ("tp", "pp", "dp", "num_microbatches", "schedule", "chunks", "vocab_passes", "split_loss", "ep")
"""The layout proper: every combination is enumerated (``ep`` only where the graph has
grouped experts). Giving any of them is giving a layout (``fxpipe run`` then searches only
with ``--world``)."""
MEMORY_FIELDS = ("zero", "sp", "recompute")
"""Fields that trade time for memory: tried, in this order and each on top of the last,
only where a layout does not fit the memory limit without them (``memory_savers``)."""
SEARCHED = LAYOUT_FIELDS + MEMORY_FIELDS
"""Every field the search decides; the rest of ``ParallelConfig`` is taken as given."""


class HeadMode(enum.Enum):
    """How a pipeline runs the LM head and its loss (each searched with pp >= 2)."""
    WHOLE = "whole"
    """On the last stage, as captured (``split_matmul`` may still cut a heavy head over stages)."""
    BLOCKWISE = "blockwise"
    """The cross-entropy block by block over a head cut over stages (``split_loss``)."""
    VOCAB_PASSES = "vocab-passes"
    """Every pipeline rank runs its block of the vocabulary (``vocab_passes``)."""


PIPELINE_SCHEDULES = (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED,
                      ScheduleKind.ZB_H1, ScheduleKind.ZB_V)


def candidate_layouts(world_size: int, rows: int, base: ParallelConfig,
                      pinned: Mapping[str, Any] = {}, experts: Sequence[int] = ()) -> Iterator[ParallelConfig]:
    """Every layout of ``world_size`` ranks for a batch of ``rows`` rows that honours the
    ``pinned`` fields (by ``ParallelConfig`` field name), the rest taken from ``base``.
    ``experts``: the expert count of each MoE the graph has (``grouped_experts``): with
    tp = 1 every ep dividing dp and every count is a layout too (under 1F1B with the head
    whole: what expert parallelism has run with)."""
    pinned = dict(pinned)
    if "schedule" in pinned:
        pinned["schedule"] = ScheduleKind.parse(pinned["schedule"])
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if rows % dp:
                continue
            eps = [e for e in divisors(dp) if experts and tp == 1 and all(n % e == 0 for n in experts)] or [1]
            for ep in eps:
                for m in divisors(rows // dp):
                    kinds = PIPELINE_SCHEDULES if pp > 1 else (ScheduleKind.ONE_F_ONE_B,)
                    for kind in kinds:
                        spec = get_spec(kind)
                        for head in (HeadMode if pp > 1 else (HeadMode.WHOLE,)):
                            if ep > 1 and (kind is not ScheduleKind.ONE_F_ONE_B or head is not HeadMode.WHOLE):
                                continue  # expert parallelism has run with 1F1B and a whole head only
                            fields = dict(tp=tp, pp=pp, dp=dp, num_microbatches=m, schedule=kind,
                                          chunks=spec.default_chunks, vocab_passes=head is HeadMode.VOCAB_PASSES,
                                          split_loss=head is HeadMode.BLOCKWISE, ep=ep)
                            if any(k in fields and fields[k] != v for k, v in pinned.items()):
                                continue
                            try:
                                yield dataclasses.replace(base, **fields)
                            except ValueError:  # a combination the layout's rules refuse
                                continue


def memory_savers(config: ParallelConfig, fixed: frozenset[str]) -> list[ParallelConfig]:
    """``config``, then the same layout holding less (``MEMORY_FIELDS``), each on top of the
    last: ZeRO-1 (dp >= 2; it moves the same bytes as the all-reduce it replaces,
    runtime/zero.py, and holds Adam's moments 1/dp), sequence parallelism (tp >= 2; the
    all-reduces become all-gathers and reduce-scatters of the same bytes, and the norms'
    activations are 1/tp), then selective and full recompute (the forward again in
    backward). Cheapest first, so the first that fits is the one to take. Fields in
    ``fixed`` (pinned, or set on the base config) are not changed."""
    tries, current = [config], config
    steps = [("zero", 1, config.replicas > 1 and config.ep == 1), ("sp", True, config.tp > 1),
             ("recompute", RecomputeMode.SELECTIVE, config.ep == 1), ("recompute", RecomputeMode.FULL, config.ep == 1)]
    for field, value, applies in steps:
        if applies and field not in fixed and getattr(current, field) != value:
            try:
                current = dataclasses.replace(current, **{field: value})
            except ValueError:  # a combination the layout's rules refuse
                continue
            tries.append(current)
    return tries
