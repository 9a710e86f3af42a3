"""The compiler chooses the layout: every layout of a world size, priced on the user's own
captured program, and the fastest that fits.

``search_layout(model, batch, world_size)`` enumerates the layouts the world and the batch
allow — tp·pp·dp = world, dp dividing the batch's rows, the number of microbatches m (so
the micro-batch size b = rows / (dp·m)), and for a pipeline every schedule (GPipe, 1F1B,
interleaved, ZB-H1, ZB-V) with the head run whole, with its loss block by block or as
vocabulary passes (``HeadMode``) — and prices
each on this model's graph, through the compile pipeline itself (``compiler/pipeline.py``):
the tensor-parallel pass at that tp, per-node times — one tp rank's compute timed here
once per (tp, micro-batch size) at those shard shapes (``fxpipe/costs/local.py``; the cost
model for a meta-device model or ``costs="model"``) — the chain-DP partition (the
fast, optimal-on-one-order split; the chosen layout is compiled with the user's method,
the ILP by default), the vocabulary passes placed on the stages' times. The step is the
schedule's simulated makespan on those stage times (``schedules/simulate.py``), with the
tensor-parallel collectives as rings on the links, the runtime's fixed cost per action,
the vocabulary passes' S and T as timed at their block, and the cores the ranks share
(``concurrent``), plus the data-parallel gradient all-reduce; the memory is the partition's per-rank model (state
plus the schedule's activations in flight). Fields the caller pins constrain the search;
a pin nothing fits is refused naming the smallest change that does.

ZeRO-1 is tried where a layout with data parallelism does not fit the memory limit
without it. What is not searched yet (kept as given): recomputation, sequence
parallelism and expert parallelism.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

from fxpipe.base.hardware import Collective, Hardware
from fxpipe.compiler.context import CompileContext, CompileHooks
from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.costs.local import LocalTimes, measure_locally, node_times_for, time_vocab_passes
from fxpipe.ir.artifact import CompiledPipeline
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import Program
from fxpipe.params.rank_state import ShardBuilder
from fxpipe.partition import Method, PartitionError
from fxpipe.planner.search import divisors
from fxpipe.schedules.registry import ScheduleKind, get_spec
from fxpipe.schedules.simulate import StageDurations, simulate

SEARCHED = ("tp", "pp", "dp", "num_microbatches", "schedule", "chunks", "vocab_passes", "split_loss", "zero")
"""The layout fields the search decides (the rest of ``ParallelConfig`` is taken as given;
``zero`` only where a layout does not fit the memory limit without it)."""
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


@dataclass(frozen=True)
class PricedLayout:
    """One layout and what the search predicts for it."""
    config: ParallelConfig
    step_s: float
    """Predicted seconds per training step: the simulated pipeline plus the dp all-reduce."""
    memory_bytes: int
    """The largest rank's predicted memory: training state plus activations in flight."""
    bubble: float
    """Simulated idle share of the step on the busiest pipeline rank (0 without a pipeline)."""
    allreduce_s: float
    """The data-parallel gradient all-reduce included in ``step_s``."""

    def describe(self) -> str:
        return describe(self.config)


def describe(c: ParallelConfig) -> str:
    """A layout in one line: ``tp=1 pp=2 dp=1 m=4 zb-v v=2 vocab-passes``."""
    what = f"tp={c.tp} pp={c.pp} dp={c.dp} m={c.num_microbatches}"
    if c.pp > 1:
        what += f" {c.schedule.value}" + (f" v={c.chunks}" if c.chunks > 1 else "")
        what += " vocab-passes" if c.vocab_passes else (" blockwise-loss" if c.split_loss else "")
    return what + (" zero-1" if c.zero else "")


@dataclass(frozen=True)
class LayoutSearch:
    """What ``search_layout`` found: the choice, every priced layout, and what was refused."""
    world_size: int
    chosen: PricedLayout
    ranked: tuple[PricedLayout, ...]
    """Every layout that compiled and fits, fastest first (``chosen`` is the first)."""
    refused: tuple[tuple[str, str], ...]
    """(layout, why): layouts that could not be compiled for this model, or do not fit."""
    seconds: float
    costs: str = ""
    """How compute was priced: timed here at the layouts' shapes, or the cost model."""
    notes: tuple[str, ...] = ()
    """Shapes whose timing failed (priced by the cost model instead)."""

    def table(self, top: int = 5) -> str:
        """The leading layouts, one line each, and why the winner beats the runner-up."""
        lines = [f"layout search over {len(self.ranked) + len(self.refused)} layouts of {self.world_size} "
                 f"ranks ({self.seconds:.1f} s; {self.costs or 'cost model'}): predicted step, largest rank's "
                 f"memory, bubble"] + [f"note: {n}" for n in self.notes]
        for i, p in enumerate(self.ranked[:top]):
            mark = "->" if i == 0 else "  "
            lines.append(f"{mark} {p.describe():<42} {1e3 * p.step_s:9.2f} ms  {p.memory_bytes / 2**20:9.1f} MiB  "
                         f"bubble {100 * p.bubble:4.1f}%")
        if len(self.ranked) > 1:
            a, b = self.ranked[0], self.ranked[1]
            lines.append(f"chosen: {a.describe()}, {b.step_s / a.step_s:.2f}x faster than {b.describe()} "
                         f"(bubble {100 * a.bubble:.1f}% vs {100 * b.bubble:.1f}%, all-reduce "
                         f"{1e3 * a.allreduce_s:.2f} vs {1e3 * b.allreduce_s:.2f} ms)")
        return "\n".join(lines)


def candidate_layouts(world_size: int, rows: int, base: ParallelConfig,
                      pinned: Mapping[str, Any] = {}) -> Iterator[ParallelConfig]:
    """Every layout of ``world_size`` ranks for a batch of ``rows`` rows that honours the
    ``pinned`` fields (by ``ParallelConfig`` field name), the rest taken from ``base``."""
    pinned = dict(pinned)
    if "schedule" in pinned:
        pinned["schedule"] = ScheduleKind.parse(pinned["schedule"])
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if rows % dp:
                continue
            for m in divisors(rows // dp):
                kinds = PIPELINE_SCHEDULES if pp > 1 else (ScheduleKind.ONE_F_ONE_B,)
                for kind in kinds:
                    spec = get_spec(kind)
                    for head in (HeadMode if pp > 1 else (HeadMode.WHOLE,)):
                        fields = dict(tp=tp, pp=pp, dp=dp, num_microbatches=m, schedule=kind,
                                      chunks=spec.default_chunks, vocab_passes=head is HeadMode.VOCAB_PASSES,
                                      split_loss=head is HeadMode.BLOCKWISE)
                        if any(k in fields and fields[k] != v for k, v in pinned.items()):
                            continue
                        try:
                            yield dataclasses.replace(base, **fields)
                        except ValueError:  # a combination the layout's rules refuse
                            continue


# The tensor-parallel ops (fxpipe/tp/ops.py) by the collective each runs forward and
# backward, with the tensor size it moves as a multiple of the op's output (the full,
# gathered size, as ``Hardware.collective_s`` takes it); the vocabulary-parallel loss
# all-reduces three fp32 statistics per token (max, sum-exp, target logit).
# ``True``: the moved tensor is the op's input, tp times its output (a reduce-scatter's
# input, a scatter's gradient).
_TP_FORWARD = {"reduce_from_tp": (Collective.ALL_REDUCE, False), "all_reduce_max": (Collective.ALL_REDUCE, False),
               "vocab_parallel_embedding": (Collective.ALL_REDUCE, False),
               "gather_seq": (Collective.ALL_GATHER, False), "reduce_scatter_seq": (Collective.REDUCE_SCATTER, True),
               "gather": (Collective.ALL_GATHER, False)}
_TP_BACKWARD = {"copy_to_tp": (Collective.ALL_REDUCE, False), "gather_seq": (Collective.REDUCE_SCATTER, False),
                "reduce_scatter_seq": (Collective.ALL_GATHER, True), "scatter": (Collective.ALL_GATHER, True)}
_LOSS_STATISTICS = 3


def tp_collective_times(program: Program, tp: int, hw: Hardware, num_stages: int) -> tuple[list[float], list[float]]:
    """Per stage, the seconds one microbatch's tensor-parallel collectives take forward and
    backward on the hardware's links (the cost pass prices compute, not these)."""
    fwd, bwd = [0.0] * num_stages, [0.0] * num_stages
    if tp == 1:
        return fwd, bwd
    per_node = hw.members_per_node(tp, 1)
    for node in program.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "fxpipe_tp":
            continue
        name, stage = node.target._schema.name.split("::")[1], program.stages.get(node.name, 0)
        out = program.costs[node.name].out_bytes if node.name in program.costs else 0
        if name == "vocab_parallel_cross_entropy":
            logits = node.args[0].meta["val"]
            tokens = logits.numel() // logits.shape[-1]
            fwd[stage] += _LOSS_STATISTICS * hw.collective_s(Collective.ALL_REDUCE, 4 * tokens, tp, per_node)
            continue
        for table, times in ((_TP_FORWARD, fwd), (_TP_BACKWARD, bwd)):
            if name in table:
                kind, of_input = table[name]
                times[stage] += hw.collective_s(kind, out * (tp if of_input else 1), tp, per_node)
    return fwd, bwd


def with_action_overhead(d: StageDurations, overhead: float, split: bool) -> StageDurations:
    """Every compute action ``overhead`` seconds longer: F, B (under a split backward I and W
    each, so B = I + W carries two), S and T."""
    if overhead <= 0:
        return d
    per_b = 2 * overhead if split else overhead
    return dataclasses.replace(
        d, forward=tuple(f + overhead for f in d.forward), backward=tuple(b + per_b for b in d.backward),
        weight=tuple(w + overhead for w in d.weight) if split else d.weight,
        vocab_forward=tuple(s + overhead for s in d.vocab_forward),
        vocab_backward=tuple(t + overhead for t in d.vocab_backward))


def price(compiled: CompiledPipeline, hardware: Hardware | None = None, *,
          concurrent: int | None = None, vocab_passes_s: tuple[float, float] | None = None) -> PricedLayout:
    """Predicted step time and memory of a compiled layout (module docstring), on
    ``hardware`` (default: the one its partition was priced on). ``concurrent``: how many
    ranks can compute at once on the machine (None: each has a device of its own); fewer
    than the world and the ranks' summed compute time-shares what there is.
    ``vocab_passes_s``: one vocabulary pass S and T as timed (``time_vocab_passes``),
    instead of the head's share of the partition's times."""
    config, program = compiled.config, compiled.program
    result = program.partition
    hw = hardware or program.partition_config.hardware
    stages = result.stages
    if compiled.vocab_timing is not None:
        timing = compiled.vocab_timing
        durations, p2p, collective = timing.durations, timing.p2p_latency, timing.collective_latency
        if vocab_passes_s is not None:
            pp = len(durations.vocab_forward)
            durations = dataclasses.replace(durations, vocab_forward=(vocab_passes_s[0],) * pp,
                                            vocab_backward=(vocab_passes_s[1],) * pp)
    else:
        backward = tuple(c.bwd_s for c in stages)
        durations = StageDurations(forward=tuple(c.fwd_s for c in stages), backward=backward,
                                   weight=tuple(b / 2 for b in backward))
        p2p = hw.p2p_s(max((c.send_bytes for c in stages), default=0), intra_node=True)
        collective = None
    comm_f, comm_b = tp_collective_times(program, config.tp, hw, len(durations.forward))
    durations = dataclasses.replace(durations, forward=tuple(f + c for f, c in zip(durations.forward, comm_f)),
                                    backward=tuple(b + c for b, c in zip(durations.backward, comm_b)))
    durations = with_action_overhead(durations, hw.action_overhead_s, compiled.schedule.splits_backward)
    sim = simulate(compiled.schedule, durations, p2p_latency=p2p, collective_latency=collective)
    makespan = sim.makespan
    world = config.tp * config.pp * config.replicas
    if concurrent is not None and concurrent < world:
        # Every tp rank and replica runs the pipeline's compute: the machine does all of it.
        makespan = max(makespan, sum(sim.busy) * config.tp * config.replicas / concurrent)
    # Every data-parallel replica sums its gradients: the largest rank's, in fp32.
    params = max(sum(c.params for c in stages if c.rank == r) for r in range(config.pp))
    grads = 4 * params
    allreduce = hw.collective_s(Collective.ALL_REDUCE, grads, config.replicas,
                                hw.members_per_node(config.replicas, config.tp))
    bubble = sim.max_bubble_fraction if config.pp > 1 else 0.0
    return PricedLayout(config=config, step_s=makespan + allreduce, memory_bytes=max(result.rank_memory_bytes),
                        bubble=bubble, allreduce_s=allreduce)


def ranks_at_once(world_size: int, device: torch.device | str = "cpu") -> int | None:
    """How many of ``world_size`` running ranks (this one among them) can compute at once:
    on CPUs, the cores over each rank's threads, per node (None when every rank has cores
    of its own, or on GPUs)."""
    if torch.device(device).type != "cpu":
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    at_once = max(1, (os.cpu_count() or 1) // torch.get_num_threads())
    return at_once * max(1, world_size // per_node) if per_node > at_once else None


def local_world(world_size: int) -> tuple[int, int | None]:
    """(threads per rank, ``concurrent``) for ``world_size`` CPU ranks to be started on this
    machine, as ``fxpipe run`` starts them (each with cores / ranks threads, at least one)."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // world_size)
    return threads, (cores // threads if world_size * threads > cores else None)


class _Costs:
    """Per (tp, micro-batch size): the capture, and its compute timed at those shard
    shapes (``fxpipe/costs/local.py``) — once, shared by every layout that needs them."""

    def __init__(self, model: nn.Module, batch: tuple[torch.Tensor, ...], base: ParallelConfig,
                 loss_fn: Callable | None, measure: bool, threads: int | None) -> None:
        self.model, self.batch, self.base, self.loss_fn = model, batch, base, loss_fn
        self.measure, self.threads = measure, threads
        self.programs: dict[int, Program] = {}
        self.timed: dict[tuple[int, int], LocalTimes | None] = {}
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
        key = (config.tp, rows)
        if key not in self.timed:
            self.timed[key] = self._time(config, rows)
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
            threads = torch.get_num_threads()
            torch.set_num_threads(self.threads or threads)
            try:
                self.passes[key] = time_vocab_passes(*key)
            finally:
                torch.set_num_threads(threads)
        return self.passes[key]

    def _time(self, config: ParallelConfig, rows: int) -> LocalTimes | None:
        program = compile_program(self.program(rows), dataclasses.replace(config, costs="model"), until="cost").program
        shards = ShardBuilder(program, program.tp_specs, self.model, tp_rank=0, device=torch.device("cpu"),
                              seed=self.base.seed)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads or threads)
        try:
            return measure_locally(program, program.partition_config or CompileContext.of(config).partition,
                                   tuple(t[:rows] for t in self.batch), shards.tensors, tp=config.tp)
        except Exception as exc:  # noqa: BLE001 - a graph that cannot run alone keeps the cost model
            self.notes.append(f"tp={config.tp} b={rows}: timing failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''}), cost model used")
            return None
        finally:
            torch.set_num_threads(threads)


def search_layout(model: nn.Module, batch: Sequence[torch.Tensor], world_size: int, *,
                  loss_fn: Callable[..., torch.Tensor] | None = None, base: ParallelConfig | None = None,
                  pinned: Mapping[str, Any] = {}, threads: int | None = None,
                  concurrent: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> LayoutSearch:
    """The fastest layout of ``world_size`` ranks for ``model`` on the global ``batch`` that
    fits ``base.memory_limit_gb`` (module docstring). ``base``: every field the search does
    not decide; ``pinned``: fields it must keep (by ``ParallelConfig`` field name).
    Under ``base.costs == "measure"`` (the default) and a model with weights, each layout's
    compute is timed here at its shard shapes with ``threads`` threads (default: this
    process's), as each rank will run; ``concurrent``: as ``price``; ``progress(done,
    total)``: called as layouts are priced (``report_progress`` prints it)."""
    start = time.perf_counter()
    base = base or ParallelConfig()
    batch = tuple(batch) if not isinstance(batch, torch.Tensor) else (batch,)
    rows = batch[0].shape[0]
    unknown = set(pinned) - set(SEARCHED)
    if unknown:
        raise ValueError(f"the layout search decides {', '.join(SEARCHED)}; {sorted(unknown)} are set on the "
                         f"config itself")
    pinned = dict(pinned)
    for field in ("split_loss", "vocab_passes"):  # a head mode the caller set is kept
        if getattr(base, field) and field not in pinned:
            pinned[field] = True
    measure = base.costs == "measure" and not any(p.is_meta for p in model.parameters())
    costs = _Costs(model, batch, base, loss_fn, measure, threads)
    priced, refused, needs_over_limit = [], [], []
    limit = base.memory_limit_bytes
    candidates = list(candidate_layouts(world_size, rows, base, pinned))
    heads_cut: dict[tuple, bool] = {}
    for index, config in enumerate(candidates):
        if progress is not None:
            progress(index, len(candidates))
        b = rows // (config.replicas * config.num_microbatches)
        # ZeRO-1 moves the same bytes as the all-reduce it replaces (runtime/zero.py) and
        # holds Adam's moments 1/dp: tried where the layout does not fit without it.
        tries = [config] + ([dataclasses.replace(config, zero=1)] if config.replicas > 1 and not config.zero
                            and "zero" not in pinned and limit is not None else [])
        # The blockwise loss needs a head the compile cut into blocks: known from the whole
        # head's layout, compiled just before it (candidate_layouts' order).
        shape = (config.tp, config.pp, config.dp, config.num_microbatches, config.schedule, config.chunks)
        if config.split_loss and heads_cut.get(shape) is False:
            refused.append((describe(config), _NOT_CUT))
            continue
        for attempt in tries:
            name = describe(attempt)
            try:
                fast = dataclasses.replace(attempt, partition=Method.DP, memory_limit_gb=None,
                                           costs="measure" if measure else "model")
                compiled = compile_program(costs.program(b), fast, hooks=costs.hooks(attempt, b))
                if not attempt.split_loss and not attempt.vocab_passes:
                    heads_cut[shape] = bool(compiled.program.matmul_splits)
                if attempt.split_loss and not compiled.program.loss_splits:
                    refused.append((name, _NOT_CUT))
                    break
                layout = price(compiled, concurrent=concurrent, vocab_passes_s=costs.vocab_passes(compiled))
            except (ValueError, PartitionError) as exc:  # this model cannot take the layout
                refused.append((name, " ".join(str(exc).split())[:200]))
                break
            layout = dataclasses.replace(layout, config=attempt)
            if limit is None or layout.memory_bytes <= limit:
                priced.append(layout)
                break
            needs_over_limit.append(layout.memory_bytes)
            refused.append((name, f"needs {layout.memory_bytes / 2**30:.2f} GiB per rank, over the limit "
                                  f"{limit / 2**30:.2f} GiB"))
    if progress is not None:
        progress(len(candidates), len(candidates))
    if not priced:
        raise ValueError(_nothing_fits(world_size, rows, pinned, refused, needs_over_limit, limit))
    ranked = sorted(priced, key=lambda p: (p.step_s, p.memory_bytes, p.config.pp, p.config.num_microbatches))
    timed = [t for t in costs.timed.values() if t is not None]
    threads = threads or torch.get_num_threads()
    how = (f"compute timed here at each layout's shard shapes ({len(timed)} shapes, {threads} thread(s))" if timed
           else f"cost model ({base.hardware})")
    if concurrent is not None and concurrent < world_size:
        how += f", {concurrent} rank(s) computing at once"
    return LayoutSearch(world_size=world_size, chosen=ranked[0], ranked=tuple(ranked), refused=tuple(refused),
                        seconds=time.perf_counter() - start, costs=how, notes=tuple(costs.notes))


_NOT_CUT = "the head is not cut into blocks at this layout: its blockwise loss is the whole head's"


def report_progress(done: int, total: int) -> None:
    """Progress on a long search, on stderr: a line at each quarter of the layouts."""
    if total and (done == total or done * 4 // total != (done - 1) * 4 // total) and done > 0:
        print(f"fxpipe: layout search: {done}/{total} layouts priced", file=sys.stderr, flush=True)


def _nothing_fits(world_size: int, rows: int, pinned: Mapping[str, Any], refused: list, needs: list[int],
                  limit: int | None) -> str:
    """The refusal: what was asked, the closest layout and the change that makes it fit."""
    asked = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in pinned.items()) or "no pinned field"
    if not refused:
        return (f"no layout of {world_size} ranks honours {asked} for a batch of {rows} rows; dp must divide "
                f"the rows and tp·pp·dp equal the world: unpin a field or change the world size")
    if needs and limit is not None:
        least = min(needs) / 2**30
        return (f"no layout of {world_size} ranks with {asked} fits {limit / 2**30:.2f} GiB per rank; the "
                f"smallest needs {least:.2f} GiB: raise memory_limit_gb to {least:.2f}, unpin a field, or use "
                f"more ranks")
    name, why = refused[0]
    return f"no layout of {world_size} ranks with {asked} compiles for this model; e.g. {name}: {why}"
