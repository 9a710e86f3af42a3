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
from datetime import timedelta
from typing import Any, Mapping

import torch

from fxpipe.data import DataStream
from fxpipe.job.config import TrainConfig
from fxpipe.job.flags import in_flag_words
from fxpipe.job.prepare import build_job
from fxpipe.planner.auto_layout import cache_enabled
from fxpipe.planner.layout_price import local_world
from fxpipe.planner.resolve import resolve_layout
from fxpipe.runtime.launch import init_distributed, launched_world, local_world_size


def default_world() -> int:
    """Ranks a run searches for when ``--world`` is not given: one per GPU, else the
    default layout's (tp=2 × pp=2)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    default = TrainConfig().parallel
    return default.tp * default.pp * default.dp


def choose_run_layout(config: TrainConfig, world: int, pinned: Mapping[str, Any]) -> TrainConfig:
    """``config`` with the searched fields chosen for ``world`` ranks (module docstring);
    the search's table printed (by global rank 0 under torchrun, which every rank hears)."""
    launched = launched_world()
    if launched is not None:
        if world != launched:
            raise ValueError(f"--world {world}, but torchrun started {launched} ranks; give --world {launched} "
                             f"or leave it out")
        init_distributed(timedelta(seconds=config.parallel.timeout_s))
    return _search(config, world, pinned)


def _search(config: TrainConfig, world: int, pinned: Mapping[str, Any]) -> TrainConfig:
    def workload():
        print(f"fxpipe run: searching the layouts of {world} ranks for {config.model} (global batch "
              f"{config.batch} × {config.seq} tokens" + (f"; pinned: {', '.join(f'{k}={v}' for k, v in pinned.items())}"
                                                        if pinned else "") + ")", flush=True)
        w, source = build_job(config)
        batch = w.batch_from_tokens(DataStream(source.train, config.batch, seed=config.parallel.seed).next_batch())
        return w.model, batch, w.loss_fn

    # Each worker runs cores / local workers threads (job/train.py): timed as it will run.
    threads, concurrent = (None, None) if torch.cuda.is_available() else local_world(
        world, local_world_size(world))
    try:
        chosen = resolve_layout(config.parallel, pinned, world, workload, threads=threads, concurrent=concurrent,
                                cache=cache_enabled())
    except ValueError as exc:  # the search speaks the API's names; a CLI user gives flags
        raise ValueError(in_flag_words(str(exc))) from None
    return dataclasses.replace(config, parallel=chosen.config, micro_batch_size=chosen.microbatch_rows(config.batch),
                               global_batch=config.batch, world=None)
