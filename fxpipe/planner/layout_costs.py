"""The layout search's shared measurements: per micro-batch size the capture, per
(tp, micro-batch size) one tp rank's compute timed at those shard shapes
(``fxpipe/costs/local.py``), per vocabulary block its S and T — each once, shared by
every layout that needs it."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Iterator

import torch
import torch.nn as nn

from fxpipe.compiler.context import CompileContext, CompileHooks
from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.costs.local import LocalTimes, measure_locally, node_times_for, time_vocab_passes
from fxpipe.ir.artifact import CompiledPipeline
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import Program
from fxpipe.params.rank_state import ShardBuilder


class CaptureCosts:
    """Per (tp, micro-batch size): the capture, and its compute timed at those shard
    shapes (``fxpipe/costs/local.py``) — once, shared by every layout that needs them."""

    def __init__(self, model: nn.Module, batch: tuple[torch.Tensor, ...], base: ParallelConfig,
                 loss_fn: Callable | None, measure: bool, threads: int | None) -> None:
        self.model, self.batch, self.base, self.loss_fn = model, batch, base, loss_fn
        self.measure, self.threads = measure, threads
        self.programs: dict[int, Program] = {}
        self.timed: dict[tuple[int, bool, int], LocalTimes | None] = {}
        self.passes: dict[tuple, tuple[float, float]] = {}
        self.notes: list[str] = []

    def program(self, rows: int) -> Program:
        if rows not in self.programs:
            self.programs[rows] = capture_for(self.model, tuple(t[:rows] for t in self.batch), self.base,
                                              self.loss_fn)
        return self.programs[rows]

    def hooks(self, config: ParallelConfig, rows: int) -> CompileHooks:
        if not self.measure:
            return CompileHooks()
        # Timed on the graph without the memory savers and expert parallelism: recompute
        # changes when compute runs, not what it costs (the partition prices it,
        # passes/assign_stages.py); an expert-parallel rank computes about as many expert
        # rows as a replica holding every expert (its E/ep experts, every rank's tokens for
        # them), and its dispatch cannot run without its peers. Sequence parallelism
        # changes the shard shapes: timed on its own.
        key = (config.tp, config.sp, rows)
        if key not in self.timed:
            self.timed[key] = self._time(dataclasses.replace(config, ep=1, zero=0, recompute="none"), rows)
        timed = self.timed[key]
        if timed is None:
            return CompileHooks()
        return CompileHooks(node_times=lambda program, pconfig, ctx: node_times_for(
            program, pconfig, timed, ctx.schedule.splits_backward))

    def vocab_passes(self, compiled: CompiledPipeline) -> tuple[float, float] | None:
        """S and T of this layout's vocabulary block, timed here (None: not measuring, or
        no vocabulary passes)."""
        head = compiled.plan.vocab_head if compiled.plan is not None else None
        if not self.measure or head is None or compiled.vocab_timing is None:
            return None
        spec = compiled.plan.values[head.hidden].spec
        key = (math.prod(spec.shape[:-1]), spec.shape[-1], max(b - a for a, b in head.blocks), spec.dtype)
        if key not in self.passes:
            with self._threads():
                self.passes[key] = time_vocab_passes(*key)
        return self.passes[key]

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """Timing with the threads each rank will run with (default: this process's)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads or threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _time(self, config: ParallelConfig, rows: int) -> LocalTimes | None:
        program = compile_program(self.program(rows), dataclasses.replace(config, costs="model"), until="cost").program
        shards = ShardBuilder(program, program.tp_specs, self.model, tp_rank=0, device=torch.device("cpu"),
                              seed=self.base.seed)
        try:
            with self._threads():
                return measure_locally(program, program.partition_config or CompileContext.of(config).partition,
                                       tuple(t[:rows] for t in self.batch), shards.tensors, tp=config.tp)
        except Exception as exc:  # noqa: BLE001 - a graph that cannot run alone keeps the cost model
            self.notes.append(f"tp={config.tp}{' sp' if config.sp else ''} b={rows}: timing failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''}), cost model used")
            return None


