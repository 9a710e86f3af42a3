"""``fxpipe run`` without a layout: the layout search chooses it before the workers start.

With no layout flag (``--tp``, ``--pp``, ``--dp``, ``--microbatches``, ``--schedule``,
``--chunks``, ``--vocab-passes``), or with ``--world N``, the run's layout is searched
(``fxpipe/planner/auto_layout.py``) for N ranks (default: the GPUs here, else the
default layout's 4) on the run's own first global batch; the layout flags given pin
the search. The launcher searches once and starts the workers on the choice; under
torchrun global rank 0 searches and every rank receives its choice, so all ranks
compile one layout. The global batch stays what the flags say (``--global-batch``, or
b·m·dp of the defaults); the search splits it into dp replicas and m microbatches.
"""
from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any, Mapping

import torch

from fxpipe.data import DataStream
from fxpipe.job.config import TrainConfig
from fxpipe.job.flags import in_flag_words
from fxpipe.job.prepare import build_job
from fxpipe.planner.auto_layout import SEARCHED, cache_enabled, report_progress, search_layout
from fxpipe.planner.layout_price import local_world
from fxpipe.runtime.launch import init_distributed, rank0_decides


def default_world() -> int:
    """Ranks a run searches for when ``--world`` is not given: one per GPU, else the
    default layout's (tp=2 × pp=2)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    default = TrainConfig().parallel
    return default.tp * default.pp * default.dp


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_run_layout(config: TrainConfig, world: int, pinned: Mapping[str, Any]) -> TrainConfig:
    """``config`` with the searched fields chosen for ``world`` ranks (module docstring);
    the search's table printed (by global rank 0 under torchrun)."""
    if under_torchrun():
        launched = int(os.environ["WORLD_SIZE"])
        if world != launched:
            raise ValueError(f"--world {world}, but torchrun started {launched} ranks; give --world {launched} "
                             f"or leave it out")
        init_distributed(timedelta(seconds=config.parallel.timeout_s))
        return rank0_decides(lambda: _search(config, world, pinned))  # a refusal heard by every rank
    return _search(config, world, pinned)


def _search(config: TrainConfig, world: int, pinned: Mapping[str, Any]) -> TrainConfig:
    w, source = build_job(config)
    seed = config.parallel.seed
    batch = w.batch_from_tokens(DataStream(source.train, config.batch, seed=seed).next_batch())
    # Each worker runs cores / local workers threads (job/train.py): timed as it will run.
    threads, concurrent = (None, None) if torch.cuda.is_available() else local_world(
        world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    print(f"fxpipe run: searching the layouts of {world} ranks for {config.model} (global batch {config.batch} "
          f"× {config.seq} tokens" + (f"; pinned: {', '.join(f'{k}={v}' for k, v in pinned.items())}" if pinned
                                       else "") + ")", flush=True)
    try:
        found = search_layout(w.model, batch, world, loss_fn=w.loss_fn, base=config.parallel, pinned=pinned,
                              threads=threads, concurrent=concurrent, progress=report_progress,
                              cache=cache_enabled())
    except ValueError as exc:  # the search speaks the API's names; a CLI user gives flags
        raise ValueError(in_flag_words(str(exc))) from None
    print(found.table(), flush=True)
    chosen = found.chosen.config
    parallel = dataclasses.replace(config.parallel, **{f: getattr(chosen, f) for f in SEARCHED})
    rows = config.batch // (chosen.replicas * chosen.num_microbatches)
    return dataclasses.replace(config, parallel=parallel, micro_batch_size=rows, global_batch=config.batch,
                               world=None)

