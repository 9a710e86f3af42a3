"""One layout for a run: the one given, or the one the layout search chooses.

``parallelize``, ``fxpipe run`` and ``fxpipe compile`` all end up here. With pins (the
fields the caller fixed), the search (``auto_layout.search_layout``) prices the layouts
of ``world`` ranks on the caller's global batch, prints its table and the searched
fields are copied onto the caller's base config. When a process group is up, global
rank 0 searches and every rank receives its choice (``runtime/launch.rank0_decides``):
one layout on every rank, and a refusal heard by every rank alike.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.planner.auto_layout import report_progress, search_layout
from fxpipe.planner.layout_space import SEARCHED
from fxpipe.runtime.launch import rank0_decides


@dataclass(frozen=True)
class ResolvedLayout:
    """The layout a run compiles, and how it was reached."""
    config: ParallelConfig
    table: str | None = None
    """The search's table of the layouts it priced; None when the layout was given."""

    def microbatch_rows(self, batch_rows: int) -> int:
        """Rows of one microbatch of one data-parallel replica of a global batch."""
        return batch_rows // (self.config.replicas * self.config.num_microbatches)


Workload = Callable[[], tuple[nn.Module, Sequence[torch.Tensor], Callable | None]]
"""(model, global batch, loss function) to search on: built only where the search runs."""


def resolve_layout(base: ParallelConfig, pinned: Mapping[str, Any] | None, world: int, workload: Workload, *,
                   threads: int | None = None, concurrent: int | None = None,
                   cache: bool = False) -> ResolvedLayout:
    """``base`` as given when ``pinned`` is None; else ``base`` with the searched fields
    (``SEARCHED``) of the fastest layout of ``world`` ranks that fits, ``pinned`` held,
    priced on ``workload()``. ``threads``/``concurrent`` say how the ranks will run on
    this machine (the search times compute as it will run); ``cache``: reuse and keep
    the search's result on disk (``layout_cache.py``)."""
    if pinned is None:
        return ResolvedLayout(base)

    def search() -> tuple[dict[str, Any], str]:
        model, batch, loss_fn = workload()
        found = search_layout(model, batch, world, loss_fn=loss_fn, base=base, pinned=pinned, threads=threads,
                              concurrent=concurrent, progress=report_progress, cache=cache)
        table = found.table()
        print(table, flush=True)
        return {f: getattr(found.chosen.config, f) for f in SEARCHED}, table

    fields, table = rank0_decides(search)  # in one process, simply the search
    return ResolvedLayout(dataclasses.replace(base, **fields), table)
