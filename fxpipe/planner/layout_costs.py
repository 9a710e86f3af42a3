"""The layout search's shared work: per micro-batch size the capture (one export, its
shapes propagated per size: ``compiler/capture_rows.py``); per (tp, sp, ep,
micro-batch size) the compile's prefix (capture to the device pass: what the tensor- and
expert-parallel passes make does not depend on the pipeline), one tp rank's compute timed
at those shard shapes (``fxpipe/costs/local.py``) and the body's work for the search's
lower bound (``planner/layout_bound.py``); per vocabulary block its S and T — each once,
shared by every layout that needs it."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import networkx as nx
import torch
import torch.nn as nn

from fxpipe.compiler.context import CompileContext, CompileHooks
from fxpipe.compiler.pipeline import batch_captures, compile_program, pipeline_names
from fxpipe.costs.local import LocalTimes, measure_locally, node_times_for, time_lookup_part, vocab_pass_shape, vocab_passes_here
from fxpipe.ir.artifact import CompiledPipeline
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.pass_configs import PartitionConfig
from fxpipe.ir.pass_results import ModelStats
from fxpipe.ir.program import Program
from fxpipe.params.rank_state import ShardBuilder
from fxpipe.partition import PartitionError
from fxpipe.passes.assign_stages import build_problem_graph
from fxpipe.passes.outline_lookups import lookup_of
from fxpipe.passes.vocab_head import head_nodes
from fxpipe.planner.layout_bound import ShapeWork
from fxpipe.planner.layout_price import tp_collective_times
from fxpipe.planner.transfer_price import LookupWork, lookup_work, part_model_s

PREFIX_END = "device"
"""The last pass of the prefix layouts share (the device pass reads only the device, the
same for every layout); a layout's compile resumes after it."""
RESUME_AT = "split_matmul"
PER_TP = "tensor_parallel"
"""The first pass of the prefix whose result depends on the layout (tp, ep): the passes
before it run once per micro-batch size."""
_BEFORE_TP = pipeline_names()[pipeline_names().index(PER_TP) - 1]
ENOUGH_S = 0.5
"""Seconds of recorded timing after which a shape is not timed again (``time_groups``'s
``enough_s``): the search times a dozen shapes, and the large ones are steady in one repeat."""
STEADY = 0.05
"""Two recorded repeats of a shape this close to each other end its timing (``time_groups``'s
``steady``): on a quiet machine a shape's rounds agree within a few percent, and the third
repeat was a tenth of the default job's cold search. With it the search times no warm-up
round: a first round slowed by first calls (a stage graph's code generated when first run)
is out of line with the next, so a third is timed and the median leaves it out."""


class CaptureCosts:
    """Per (tp, micro-batch size): the capture, and its compute timed at those shard
    shapes (``fxpipe/costs/local.py``) — once, shared by every layout that needs them."""

    def __init__(self, model: nn.Module, batch: tuple[torch.Tensor, ...], base: ParallelConfig,
                 loss_fn: Callable | None, measure: bool, threads: int | None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.model, self.batch, self.base, self.loss_fn = model, batch, base, loss_fn
        self.progress = progress
        self.measure, self.threads = measure, threads
        self.captures = batch_captures(model, batch, base, loss_fn)  # one export for every b > 1
        self.programs: dict[int, Program] = {}
        self.timed: dict[tuple[int, bool, int], LocalTimes | None] = {}
        self.canonicals: dict[int, Program] = {}
        self.prefixes: dict[tuple, Program | Exception] = {}
        self.works: dict[tuple, ShapeWork | Exception] = {}
        self.fines: dict[int, list[tuple[PartitionConfig, nx.DiGraph]]] = {}
        self.row_lookups: dict[tuple, tuple[LookupWork, ...]] = {}
        self.parts: dict[tuple, tuple[float, float]] = {}
        self.notes: list[str] = []

    def program(self, rows: int) -> Program:
        if rows not in self.programs:
            self.programs[rows] = self.captures(rows)
        return self.programs[rows]

    def prefix(self, config: ParallelConfig, rows: int) -> Program:
        """The capture of ``rows`` rows through the passes up to ``PREFIX_END``, for
        ``config``'s tensor and expert parallelism; its model FLOPs are ``config``'s
        (``model_stats`` counts them for m·dp microbatches)."""
        ctx = CompileContext.of(config)
        key = (rows, ctx.tensor_parallel, ctx.expert_parallel)
        if isinstance(self.prefixes.get(key), Exception):
            raise self.prefixes[key]  # a shape the passes refuse is refused once, not once per layout
        if key not in self.prefixes:
            try:
                first = compile_program(self.canonical(rows, config), dataclasses.replace(config, costs="model"),
                                        resume=PER_TP, until=PREFIX_END).program
            except (ValueError, PartitionError) as exc:
                self.prefixes[key] = exc
                raise
            self.prefixes[key] = first
        program = self.prefixes[key]
        stats = program.model_stats
        return program.replace(model_stats=ModelStats(
            num_parameters=stats.num_parameters,
            flops_per_step=stats.flops_per_step * config.num_microbatches * config.replicas))

    def canonical(self, rows: int, config: ParallelConfig) -> Program:
        """The capture of ``rows`` rows through the passes before ``PER_TP`` (they read no
        layout field but the microbatch count, whose FLOPs ``prefix`` scales), shared by
        every tp and ep: canonicalize copies the whole graph, its values too."""
        if rows not in self.canonicals:
            first = compile_program(self.program(rows), dataclasses.replace(config, costs="model"),
                                    until=_BEFORE_TP).program
            per = first.model_stats.flops_per_step // (config.num_microbatches * config.replicas)
            self.canonicals[rows] = first.replace(model_stats=dataclasses.replace(first.model_stats,
                                                                                  flops_per_step=per))
        return self.canonicals[rows]

    def compile(self, config: ParallelConfig, rows: int) -> CompiledPipeline:
        """``config`` compiled from the shared prefix, as far as pricing needs: a layout with
        vocabulary passes to its plan (the passes are placed on it), the others to the
        partition (the split into stage graphs prices nothing)."""
        return compile_program(self.prefix(config, rows), config, hooks=self.hooks(config, rows),
                               resume=RESUME_AT, until=None if config.vocab_passes else "coalesce_blocks")

    def work(self, config: ParallelConfig, rows: int) -> ShapeWork:
        """The body's work at ``config``'s shape, for the search's bound (``layout_bound.py``)."""
        key = (config.tp, config.sp, config.ep, rows)
        if isinstance(self.works.get(key), Exception):
            raise self.works[key]  # a shape that does not compile fails once, not once per layout
        if key not in self.works:
            try:
                self.works[key] = self._work(config, rows)
            except (ValueError, PartitionError) as exc:
                self.works[key] = exc
                raise
        return self.works[key]

    def _work(self, config: ParallelConfig, rows: int) -> ShapeWork:
        """``work``'s computation: the body's node times summed, its collectives, its parameters."""
        bare = dataclasses.replace(config, zero=0, recompute="none")
        program = self.prefix(bare, rows)
        pconfig = CompileContext.of(bare).partition
        head = head_nodes(program)
        fine = self._fine(program, dataclasses.replace(pconfig, node_times=None))
        timed = self._timed(bare, rows)
        body = [n for n in fine.nodes if n not in head]
        if timed is not None:
            fused = [timed.fused.get(n, (fine.nodes[n]["fwd"] * timed.scale[0],
                                         fine.nodes[n]["bwd"] * timed.scale[1])) for n in body]
            split = [timed.split.get(n, f) for n, f in zip(body, fused)]
        else:
            fused = split = [(fine.nodes[n]["fwd"], fine.nodes[n]["bwd"]) for n in body]
        hw = pconfig.hardware
        comm_f, comm_b = tp_collective_times(program, config.tp, hw, 1, skip=head)
        return ShapeWork(forward_s=sum(f for f, _ in fused), backward_s=sum(b for _, b in fused),
                         backward_split_s=sum(b for _, b in split), tp_comm_s=comm_f[0] + comm_b[0],
                         params=sum(fine.nodes[n]["params"] for n in body),
                         tied_lookup_s=self._tied_lookup(program, head, hw))

    def _tied_lookup(self, program: Program, head: frozenset[str], hw) -> float:
        """``ShapeWork.tied_lookup_s``: the whole table's lookup (``time_lookup_part`` with
        every row, or the cost model) of a parameter both looked up by an embedding and read
        by the head; 0 without one."""
        params = {p.node for p in program.params}
        inputs = [n for n in program.graph.nodes if n.op == "placeholder" and n.name not in params]
        batch = {n: i for i, n in enumerate(inputs)}
        for node in program.graph.nodes:
            if node.op != "placeholder" or not any(u.name in head for u in node.users):
                continue
            for user in node.users:
                if lookup_of(user, node, batch) is not None:
                    rows, hidden = node.meta["val"].shape[:2]
                    out = user.meta["val"]
                    work = LookupWork(tokens=out.numel() // hidden, table_rows=rows, hidden=hidden, dtype=out.dtype,
                                      consumer=0, rows=(rows,))
                    timed = self.lookup_parts((work,)).get(work.part_key(rows))
                    return sum(timed) if timed is not None else sum(part_model_s(work, rows, hw))
        return 0.0

    def _fine(self, program: Program, pconfig: PartitionConfig) -> nx.DiGraph:
        """``build_problem_graph`` of a prefix, built once for the bound and the timing's
        probe groups (a prefix's graph, costs and parameters are those of its key)."""
        built = self.fines.setdefault(id(program.graph_module), [])
        for config, fine in built:
            if config == pconfig:
                return fine
        built.append((pconfig, build_problem_graph(program, pconfig)))
        return built[-1][1]

    def hooks(self, config: ParallelConfig, rows: int) -> CompileHooks:
        if not self.measure:
            return CompileHooks()
        # Timed on the graph without the memory savers and expert parallelism: recompute
        # changes when compute runs, not what it costs (the partition prices it,
        # passes/assign_stages.py); an expert-parallel rank computes about as many expert
        # rows as a replica holding every expert (its E/ep experts, every rank's tokens for
        # them), and its dispatch cannot run without its peers. Sequence parallelism
        # changes the shard shapes: timed on its own.
        timed = self._timed(config, rows)
        if timed is None:
            return CompileHooks()
        return CompileHooks(node_times=lambda program, pconfig, ctx: node_times_for(
            program, pconfig, timed, ctx.schedule.splits_backward))

    def _timed(self, config: ParallelConfig, rows: int) -> LocalTimes | None:
        """One tp rank's compute at ``config``'s shard shapes (None: not measuring, or the
        timing failed)."""
        if not self.measure:
            return None
        key = (config.tp, config.sp, rows)
        if key not in self.timed:
            self.timed[key] = self._time(dataclasses.replace(config, ep=1, zero=0, recompute="none"), rows)
            if self.progress is not None:
                self.progress(f"tp={config.tp}{' sp' if config.sp else ''} b={rows}, shape {len(self.timed)}")
        return self.timed[key]

    def vocab_passes(self, compiled: CompiledPipeline) -> tuple[float, float] | None:
        """S and T of this layout's vocabulary block, timed here (None: not measuring, or
        no vocabulary passes)."""
        head = compiled.plan.vocab_head if compiled.plan is not None else None
        if not self.measure or head is None or compiled.vocab_timing is None:
            return None
        with self._threads():  # timed once per shape and thread count (vocab_passes_here)
            return vocab_passes_here(*vocab_pass_shape(compiled.plan))

    def lookups(self, compiled: CompiledPipeline) -> tuple[LookupWork, ...]:
        """The row-split embedding lookups the runtime will run for this layout
        (``planner/transfer_price.py``): read off its plan, which a compile the search
        stopped at the partition gets by running the split and ``vocab_rows`` — once per
        partition, which the schedules of one shape mostly share."""
        if compiled.config.pp == 1:
            return ()
        ranks = compiled.schedule.stage_to_rank
        if compiled.plan is not None:
            return lookup_work(compiled.plan, ranks, compiled.config.pp)
        program = compiled.program
        key = (program.graph_module.code, tuple(sorted(program.stages.items())),
               tuple(compiled.schedule.stage_ranks), compiled.config.pp)
        if key not in self.row_lookups:
            plan = compile_program(program, compiled.config, resume="split", until="vocab_rows").plan
            self.row_lookups[key] = lookup_work(plan, ranks, compiled.config.pp)
        return self.row_lookups[key]

    def lookup_parts(self, lookups: tuple[LookupWork, ...]) -> dict[tuple, tuple[float, float]]:
        """Each owner's part of each lookup, timed here (``time_lookup_part``; empty when
        not measuring: the price models them)."""
        if not self.measure:
            return {}
        out = {}
        for work in lookups:
            for rows in {n for n in work.rows if n}:
                key = work.part_key(rows)
                if key not in self.parts:
                    with self._threads():
                        self.parts[key] = time_lookup_part(work.tokens, work.table_rows, work.hidden, rows, work.dtype)
                out[key] = self.parts[key]
        return out

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
        program = self.prefix(config, rows)
        shards = ShardBuilder(program, program.tp_specs, self.model, tp_rank=0, device=torch.device("cpu"),
                              seed=self.base.seed)
        try:
            with self._threads():
                pconfig = program.partition_config or CompileContext.of(config).partition
                return measure_locally(program, pconfig, tuple(t[:rows] for t in self.batch), shards.tensors,
                                       tp=config.tp, enough_s=ENOUGH_S, steady=STEADY, warmup=0,
                                       fine=self._fine(program, pconfig))
        except Exception as exc:  # noqa: BLE001 - a graph that cannot run alone keeps the cost model
            self.notes.append(f"tp={config.tp}{' sp' if config.sp else ''} b={rows}: timing failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''}), cost model used")
            return None


