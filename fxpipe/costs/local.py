"""One tp rank's compute, timed in this process alone, at the shard shapes of a layout.

The layout search (``fxpipe/planner/auto_layout.py``) prices candidates that need
shapes no mesh exists for yet — tp=2 and tp=4 shards of the same graph, micro-batches
of 1 to B rows — from one process, before any layout is built. ``measure_locally`` runs
the tensor-parallel graph's probe groups (``fxpipe/costs/measure.py``, the same runner
and the same groups ``costs="measure"`` times on a mesh) with a ``ShapesOnlyGroup`` as
the tp group: every collective returns its real shape from this rank's data alone, so
the compute is timed at shard shapes and the communication is left to be priced on the
links. ``node_times_for`` then gives any later compile of the same capture (another
pipeline split, another schedule) its per-node times: nodes of the timed graph keep
theirs; the blocks a split matmul cut share their op's time in proportion to the cost
model, and the blocks of a blockwise cross-entropy the time of the loss they replace; a
node the timed graph did not have takes the cost model's time scaled by what
measurement found for the rest (measured / modelled).

Where calling the groups one by one is a visible share of a shape's work, the shape is
also timed whole, as its groups are, and their times fitted to that
(``measure.fit_to_whole``).

Groups that repeat — a transformer's layers are the same ops on the same shapes — are
timed once (``repeated_groups``): each copy takes its representative's times, as the
runtime runs the same kernels on the same shapes for every layer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import networkx as nx
import torch
import torch.fx as fx

from fxpipe.base.cpu_memory import keep_freed_blocks
from fxpipe.costs import measure, probe_groups
from fxpipe.costs.measure import fit_to_whole, time_groups
from fxpipe.costs.profile import CostProfile, device_name
from fxpipe.ir.pass_configs import PartitionConfig
from fxpipe.ir.program import Program
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.passes.assign_stages import build_problem_graph
from fxpipe.passes.split import split_program
from fxpipe.runtime.head_blocks import block_gradient, block_statistics
from fxpipe.runtime.lookup_exchange import owned_lookup
from fxpipe.tp import DropoutRNG, ShapesOnlyGroup, tp_group_context

_MATMULS = {torch.ops.aten.linear.default: 1, torch.ops.aten.mm.default: 1, torch.ops.aten.addmm.default: 2}
"""Matmul ops by the argument that holds the weight (what ``split_matmul`` cuts)."""


@dataclass(frozen=True)
class LocalTimes:
    """Measured seconds per node of one tp rank's graph at one micro-batch size."""
    fused: Mapping[str, tuple[float, float]]
    """(forward, backward) per node, the backward run whole."""
    split: Mapping[str, tuple[float, float]]
    """(forward, input + weight gradient) per node, as the zero-bubble schedules run it."""
    scale: tuple[float, float]
    """Measured / modelled seconds over the timed nodes, forward and backward: for nodes
    the timed graph does not have."""
    matmuls: Mapping[str, str]
    """The weight value a matmul reads -> that matmul node (whose time its split blocks share)."""
    device: str


def measure_locally(program: Program, config: PartitionConfig, batch: Sequence[torch.Tensor],
                    state_for: Callable[[Sequence[str]], Mapping[str, torch.Tensor]], *, tp: int,
                    device: torch.device = torch.device("cpu"), repeats: int = 3,
                    enough_s: float | None = None, steady: float | None = None, warmup: int = 1,
                    fine: nx.DiGraph | None = None) -> LocalTimes:
    """Time ``program`` (after the tensor-parallel and cost passes, before any pipeline
    split) group by group in this process; ``state_for(names)`` gives tp rank 0's shards;
    ``repeats``, ``enough_s``, ``steady``, ``warmup``: as ``time_groups``; ``fine``: as ``probe_groups``."""
    keep_freed_blocks()  # as every CPU rank runs (base/cpu_memory.py)
    fine, probe = probe_groups(program, config, fine)
    n = len(probe.members)
    same = repeated_groups(program, probe.members)
    same[-1] = n - 1  # the loss's group ends the plan: always a stage of its own
    # Each group timed is a stage of its own; a run of copies between them is one stage
    # that is never run (building a stage graph per group costs more than timing it).
    stage_of, stages = [], 0
    for g in range(n):
        if same[g] == g or not g or same[g - 1] == g - 1:
            stages += 1
        stage_of.append(stages - 1)
    timed = program.replace(stages=probe.expand(stage_of))
    plan = split_program(timed, dict(timed.stages), num_stages=stages)
    mine = [stage_of[g] for g in range(n) if same[g] == g]
    names = list(dict.fromkeys(p for s in mine for p in plan.stage_params(s)))
    group, rng = ShapesOnlyGroup(tp), DropoutRNG(seed=0, tp_rank=0)
    context = (lambda: tp_group_context(group, rng)) if tp > 1 else contextlib.nullcontext
    # A group whose predecessor was not timed receives synthetic activations (and gradients
    # from after it): timing depends on shapes, not values (``time_groups``).
    # No peer is waited for here (the tp group only returns shapes), so a one-thread CPU
    # rank is timed by its thread's CPU seconds: what the machine's other work takes from
    # it at that moment is not the graph's cost.
    cpu_time = torch.get_num_threads() == 1
    # The null stage timed once, for the groups, the check below and the whole graph alike.
    fixed = measure.runner_fixed_cost(plan, device, context, cpu_time=cpu_time)
    timing = dict(repeats=repeats, warmup=warmup, context=context, enough_s=enough_s, steady=steady,
                  cpu_time=cpu_time, fixed=fixed)
    rows = time_groups(plan, mine, state_for(names), batch, device, **timing)
    rows = {g: rows[stage_of[same[g]]] for g in range(n)}
    if _calls_matter(rows, fixed):
        # The graph run whole, as one stage: what the groups' times must add up to
        # (``fit_to_whole``; a graph of many small groups was priced at 0.7 of what it
        # runs in). Timed as the groups are: its first round (the stage's first call) is
        # slower than the rest, and timed once it priced deep-narrow 1.5x.
        one = program.replace(stages=probe.expand([0] * n))
        whole_plan = split_program(one, dict(one.stages), num_stages=1)
        whole = time_groups(whole_plan, range(1), state_for(whole_plan.stage_params(0)), batch, device, **timing)[0]
        rows = fit_to_whole(rows, whole)
    profile = CostProfile(key="", device=device_name(device), groups=tuple(rows[g] for g in range(n)),
                          latency_s=0.0, bandwidth_bytes_per_s=float("inf"))
    fused, split = profile.node_times(fine, probe, False), profile.node_times(fine, probe, True)
    modelled = [sum(fine.nodes[v][k] for v in fine.nodes) for k in ("fwd", "bwd")]
    measured = [sum(t[i] for t in fused.values()) for i in (0, 1)]
    scale = tuple(m / d if d > 0 else 1.0 for m, d in zip(measured, modelled))
    matmuls = {}
    for node in program.graph.nodes:
        at = _MATMULS.get(node.target)
        if at is not None and len(node.args) > at and hasattr(node.args[at], "name"):
            matmuls.setdefault(node.args[at].name, node.name)
    return LocalTimes(fused=fused, split=split, scale=scale, matmuls=matmuls, device=profile.device)


CALLS_MATTER = 0.15
"""The share of a shape's timed forward + backward that calling its groups one by one may
take (the null stage's cost per group) before the shape is timed whole as well: below it,
fitting to the whole moves the price by less than the search can tell apart, and timing
a large shape whole again costs seconds (gpt-small, 16 rows of 128 tokens: 1.9 s for one
round)."""


def _calls_matter(rows: Mapping[int, tuple[float, ...]], fixed: Sequence[float]) -> bool:
    """Whether the per-group calls are a visible share of the shape (``CALLS_MATTER``)."""
    work = sum(r[0] + r[1] for r in rows.values())
    return len(rows) * (fixed[0] + fixed[1]) > CALLS_MATTER * work


def _spec(value: object) -> object:
    """A node argument as the kernel sees it: a tensor by shape and dtype, a node without a
    tensor by its kind, anything else as written (dims, scalars, flags)."""
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            # A data-dependent size (an MoE's routed token count) is a SymInt, which does
            # not hash: it is named by its symbol, so copies routed alike still match.
            return ("tensor", tuple(d if isinstance(d, int) else str(d) for d in val.shape), str(val.dtype))
        return ("node", value.op, repr(val) if val is not None else None)
    if isinstance(value, (list, tuple)):
        return tuple(_spec(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _spec(v)) for k, v in sorted(value.items()))
    return repr(value)


def repeated_groups(program: Program, members: Sequence[Sequence[str]]) -> list[int]:
    """For each probe group, the first group that runs the same ops on the same shapes,
    dtypes and arguments in the same order (itself when none does): what is timed once
    and shared. Which value feeds which op inside the group is part of the signature, so
    two groups wired differently are not taken for each other."""
    nodes = {n.name: n for n in program.graph.nodes}
    first: dict[tuple, int] = {}
    out = []
    for g, names in enumerate(members):
        local = {name: i for i, name in enumerate(names)}
        key = []
        for name in names:
            node = nodes.get(name)
            if node is None:  # not a graph node: never shared
                key = [("group", g)]
                break
            wiring = tuple(local.get(a.name, -1) for a in node.all_input_nodes)
            key.append((node.op, str(node.target), _spec(node.args), _spec(node.kwargs), wiring,
                        _spec(node)))
        out.append(first.setdefault(tuple(key), g))
    return out


def node_times_for(program: Program, config: PartitionConfig, measured: LocalTimes,
                   split_backward: bool) -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds of every node the partition sees in ``program`` — a
    compile of the capture ``measured`` was timed on (module docstring)."""
    fine = build_problem_graph(program, dataclasses.replace(config, node_times=None))
    known = measured.split if split_backward else measured.fused
    out: dict[str, tuple[float, float]] = {}
    for split in program.matmul_splits:
        whole = known.get(measured.matmuls.get(split.weight, ""))
        if whole is not None:
            _share(out, fine, [n for b in split.blocks for n in b.nodes], whole)
    # A cross-entropy computed block by block stands in for the captured chain and loss: its
    # blocks share their timed cost (priced by the cost model instead, wide-vocab's 14
    # blocks of 19 small ops each were 13x the 0.33 ms its timed loss took).
    for loss in program.loss_splits:
        timed = [known[n] for n in loss.replaced if n in known]
        if timed:
            _share(out, fine, [n for b in loss.blocks for n in b.nodes], tuple(map(sum, zip(*timed))))
    for n in fine.nodes:
        if n not in out:
            modelled = (fine.nodes[n]["fwd"] * measured.scale[0], fine.nodes[n]["bwd"] * measured.scale[1])
            out[n] = known.get(n) or modelled
    return out


def _share(out: dict[str, tuple[float, float]], fine: nx.DiGraph, nodes: Sequence[str],
           whole: tuple[float, float]) -> None:
    """``whole`` (forward, backward) shared over ``nodes`` in proportion to the cost model."""
    members = [n for n in nodes if n in fine]
    for i, key in enumerate(("fwd", "bwd")):
        total = sum(fine.nodes[n][key] for n in members)
        for n in members:
            share = fine.nodes[n][key] / total if total > 0 else 1 / len(members)
            prev = out.get(n, (0.0, 0.0))
            out[n] = (whole[0] * share, prev[1]) if i == 0 else (prev[0], whole[1] * share)


def vocab_pass_shape(plan: PipelinePlan) -> tuple[int, int, int, torch.dtype]:
    """(tokens, hidden, block width, dtype) of one vocabulary pass of ``plan``'s head: its
    input's tokens and width, the widest rank's block of rows — what
    ``vocab_passes_here`` times."""
    head = plan.vocab_head
    assert head is not None, "the plan has no vocabulary head"
    spec = plan.values[head.hidden].spec
    return math.prod(spec.shape[:-1]), spec.shape[-1], max(b - a for a, b in head.blocks), spec.dtype


def vocab_passes_here(tokens: int, hidden: int, width: int, dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """``time_vocab_passes`` once per block shape and thread count in this process: the
    compile places the vocabulary passes on these times (``compiler/vocab_placement.py``)
    and the layout search prices them with the same ones."""
    return _vocab_passes_cached(tokens, hidden, width, dtype, torch.get_num_threads())


@functools.lru_cache(maxsize=64)
def _vocab_passes_cached(tokens: int, hidden: int, width: int, dtype: torch.dtype, threads: int) -> tuple[float, float]:
    return time_vocab_passes(tokens, hidden, width, dtype)


def time_vocab_passes(tokens: int, hidden: int, width: int, dtype: torch.dtype = torch.float32, *,
                      repeats: int = 3) -> tuple[float, float]:
    """Median seconds of one vocabulary pass S and one T (``runtime/head_blocks.py``'s
    math: the block's logits and statistics; their gradient back through the block) on
    a block of ``width`` vocabulary rows for ``tokens`` tokens of width ``hidden``. The
    captured cross-entropy is not what the passes run: they make several passes over
    the block's logits of their own, which the head's timed nodes do not show."""
    keep_freed_blocks()  # as every CPU rank runs (base/cpu_memory.py)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_(True)
    w = (0.02 * torch.randn(width, hidden, generator=gen)).to(dtype).requires_grad_(True)
    target = torch.randint(0, width, (tokens,), generator=gen)
    weight = torch.full((tokens,), 1.0 / tokens)
    s_times, t_times = [], []
    now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter  # as measure._Clock
    for _ in range(repeats + 1):  # the first: warm-up
        start = now()
        with torch.enable_grad():
            logits = torch.nn.functional.linear(x, w)
        stats = block_statistics(logits, target, 0, 0)
        mid = now()
        torch.autograd.backward([logits], [block_gradient(logits, stats, target, 0, 0, weight)])
        s_times.append(mid - start)
        t_times.append(now() - mid)
    x.grad = w.grad = None
    return statistics.median(s_times[1:]), statistics.median(t_times[1:])


def time_lookup_part(tokens: int, table_rows: int, hidden: int, rows: int, dtype: torch.dtype = torch.float32, *,
                     repeats: int = 5) -> tuple[float, float]:
    """Median seconds of one rank's part of a row-split embedding lookup
    (``runtime/lookup_exchange.owned_lookup``) for ``tokens`` ids over a table of
    ``table_rows`` rows of which this rank owns ``rows``, forward and backward (the
    dense gradient of its rows)."""
    keep_freed_blocks()  # as every CPU rank runs (base/cpu_memory.py)
    gen = torch.Generator().manual_seed(0)
    table = (0.02 * torch.randn(max(rows, 1), hidden, generator=gen)).to(dtype).requires_grad_(True)
    owned = torch.full((table_rows,), -1, dtype=torch.long)
    owned[:rows] = torch.arange(rows)
    ids = torch.randint(0, table_rows, (tokens,), generator=gen)
    grad = torch.randn(tokens, hidden, generator=gen).to(dtype)
    f_times, b_times = [], []
    now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter  # as measure._Clock
    for _ in range(repeats + 1):  # the first: warm-up
        start = now()
        out = owned_lookup(table, owned, ids, -1)
        mid = now()
        torch.autograd.backward([out], [grad])
        f_times.append(mid - start)
        b_times.append(now() - mid)
    return statistics.median(f_times[1:]), statistics.median(b_times[1:])
