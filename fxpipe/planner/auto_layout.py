"""The compiler chooses the layout: every layout of a world size, priced on the user's own
captured program, and the fastest that fits.

``search_layout(model, batch, world_size)`` enumerates the layouts the world and the batch
allow — tp·pp·dp = world, dp dividing the batch's rows, the number of microbatches m (so
the micro-batch size b = rows / (dp·m)), and for a pipeline every schedule (GPipe, 1F1B,
interleaved, ZB-H1, ZB-V) with the head run whole, with its loss block by block or as
vocabulary passes (``layout_space.HeadMode``) — and prices
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

Layouts are priced in order of a lower bound on their price (``layout_bound.py``) from
compiles that resume after a prefix shared per shape (``layout_costs.py``), and the search
stops where the bound exceeds the best price: the choice is exhaustive pricing's. A
result can be remembered on disk (``layout_cache.py``).

Where the graph has grouped experts (an MoE), expert parallelism is a dimension too
(ep dividing dp, at tp = 1). ZeRO-1, sequence parallelism and recomputation
(``MEMORY_FIELDS``) are tried where a layout does not fit the memory limit without
them, cheapest first (``layout_space.memory_savers``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.partition import Method, PartitionError
from fxpipe.passes.expert_parallel import grouped_experts
from fxpipe.planner import layout_cache
from fxpipe.planner.layout_bound import layout_bound_s
from fxpipe.planner.layout_costs import CaptureCosts
from fxpipe.planner.layout_price import PricedLayout, describe, price
from fxpipe.planner.layout_space import MEMORY_FIELDS, SEARCHED, candidate_layouts, memory_savers
from fxpipe.schedules.registry import ScheduleKind


@dataclass(frozen=True)
class SearchBudget:
    """How much pricing a search may do: layouts priced, and seconds from the first
    (after the shapes are timed and the bounds known)."""
    max_layouts: int = 2000
    seconds: float = 30.0


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
    pruned: int = 0
    """Layouts not priced: their lower bound exceeded the best price (``stopped ==
    "bound"``, they cannot win), or the budget ran out (``"budget"``, they might)."""
    stopped: str = ""
    cached: str = ""
    """Where the search was read from when it was not run (``planner/layout_cache.py``)."""

    def table(self, top: int = 5) -> str:
        """The leading layouts, one line each, and why the winner beats the runner-up."""
        lines = [f"layout search over {len(self.ranked) + len(self.refused) + self.pruned} layouts of "
                 f"{self.world_size} ranks ({self.seconds:.1f} s; {self.costs or 'cost model'}): predicted step, "
                 f"largest rank's memory, bubble"] + [f"note: {n}" for n in self.notes]
        if self.cached:
            lines.insert(0, f"layout search cached: {self.cached} (no layout priced this run)")
        if self.stopped == "bound":
            lines.append(f"{self.pruned} layouts not priced: their lower bound exceeds the best price")
        elif self.stopped == "budget":
            lines.append(f"{self.pruned} layouts not priced: the search's budget ran out (the choice is the "
                         f"best of those priced)")
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


def search_layout(model: nn.Module, batch: Sequence[torch.Tensor], world_size: int, *,
                  loss_fn: Callable[..., torch.Tensor] | None = None, base: ParallelConfig | None = None,
                  pinned: Mapping[str, Any] = {}, threads: int | None = None,
                  concurrent: int | None = None, exhaustive: bool = False,
                  budget: SearchBudget = SearchBudget(), cache: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> LayoutSearch:
    """The fastest layout of ``world_size`` ranks for ``model`` on the global ``batch`` that
    fits ``base.memory_limit_gb`` (module docstring). ``base``: every field the search does
    not decide; ``pinned``: fields it must keep (by ``ParallelConfig`` field name).
    Under ``base.costs == "measure"`` (the default) and a model with weights, each layout's
    compute is timed here at its shard shapes with ``threads`` threads (default: this
    process's), as each rank will run; ``concurrent``: as ``price``; ``progress(done,
    total)``: called as layouts are priced (``report_progress`` prints it).

    Layouts are priced in order of a lower bound on their price (``layout_bound.py``) and
    the search stops at the first whose bound exceeds the best price: the choice is the
    one pricing all of them makes. ``exhaustive``: price every layout (``ranked`` then
    holds all that fit). ``budget``: at most that many layouts and seconds of pricing
    (what it left unpriced is counted in ``LayoutSearch.pruned``). ``cache``: read the
    result from disk where this very search ran before, and write it there after
    (``planner/layout_cache.py``)."""
    start = time.perf_counter()
    base = base or ParallelConfig()
    batch = tuple(batch) if not isinstance(batch, torch.Tensor) else (batch,)
    rows = batch[0].shape[0]
    unknown = set(pinned) - set(SEARCHED)
    if unknown:
        raise ValueError(f"the layout search decides {', '.join(SEARCHED)}; {sorted(unknown)} are set on the "
                         f"config itself")
    pinned = dict(pinned)
    defaults = ParallelConfig()
    for field in ("split_loss", "vocab_passes", "ep", *MEMORY_FIELDS):  # what the caller set is kept
        if getattr(base, field) != getattr(defaults, field) and field not in pinned:
            pinned[field] = getattr(base, field)
    base = dataclasses.replace(base, **{f: pinned[f] for f in MEMORY_FIELDS if f in pinned})
    fixed = frozenset(pinned)
    measure = base.costs == "measure" and not any(p.is_meta for p in model.parameters())
    costs = CaptureCosts(model, batch, base, loss_fn, measure, threads,
                         None if progress is None else lambda what: print(
                             f"fxpipe: layout search: timed {what} ({time.perf_counter() - start:.1f} s)",
                             file=sys.stderr, flush=True))
    priced, refused, needs_over_limit = [], [], []
    limit = base.memory_limit_bytes
    # m = rows / dp is always a candidate: the one-row capture is needed anyway.
    experts = grouped_experts(costs.program(1))
    _check_ep(pinned.get("ep", 1), experts)
    if cache:
        key = layout_cache.search_key(costs.program(1), [(t.shape, str(t.dtype)) for t in batch], world_size,
                                      base, pinned, threads, concurrent)
        path = layout_cache.cache_dir() / f"{layout_cache._digest(key)}.json"
        found = _from_cache(path, key, base, world_size, rows, pinned, start)
        if found is not None:
            return found
    candidates = list(candidate_layouts(world_size, rows, base, pinned, experts))
    bounds = {} if exhaustive else _bounds(candidates, rows, costs, fixed, limit, concurrent, refused)
    order = sorted((i for i in range(len(candidates)) if exhaustive or i in bounds),
                   key=lambda i: (bounds.get(i, 0.0), i))
    heads_cut: dict[tuple, bool] = {}
    best, stopped, pricing = float("inf"), "", time.perf_counter()
    done = 0
    for done, index in enumerate(order):
        config = candidates[index]
        if not exhaustive and bounds[index] > best:
            stopped = "bound"
            break
        if priced and (done >= budget.max_layouts or time.perf_counter() - pricing > budget.seconds):
            stopped = "budget"  # never before one layout is priced: a search always answers
            break
        if progress is not None:
            progress(done, len(order))
        b = rows // (config.replicas * config.num_microbatches)
        tries = memory_savers(config, fixed) if limit is not None else [config]
        # The blockwise loss needs a head the compile cut into blocks: known from the whole
        # head's layout where it was compiled first.
        shape = (config.tp, config.pp, config.dp, config.num_microbatches, config.schedule, config.chunks, config.ep)
        if config.split_loss and heads_cut.get(shape) is False:
            refused.append((describe(config), _NOT_CUT))
            continue
        for attempt in tries:
            name = describe(attempt)
            try:
                fast = dataclasses.replace(attempt, partition=Method.DP, memory_limit_gb=None,
                                           costs="measure" if measure else "model")
                compiled = costs.compile(fast, b)
                if not attempt.split_loss and not attempt.vocab_passes:
                    heads_cut[shape] = bool(compiled.program.matmul_splits)
                if attempt.split_loss and not compiled.program.loss_splits:
                    refused.append((name, _NOT_CUT))
                    break
                rows_split = costs.lookups(compiled)
                layout = price(compiled, concurrent=concurrent, vocab_passes_s=costs.vocab_passes(compiled),
                               lookups=rows_split, lookup_parts=costs.lookup_parts(rows_split))
            except (ValueError, PartitionError) as exc:  # this model cannot take the layout
                refused.append((name, " ".join(str(exc).split())[:200]))
                break
            layout = dataclasses.replace(layout, config=attempt)
            if limit is None or layout.memory_bytes <= limit:
                priced.append(layout)
                best = min(best, layout.step_s)
                break
            needs_over_limit.append(layout.memory_bytes)
            refused.append((name, f"needs {_gib(layout.memory_bytes)} GiB per rank, over the limit "
                                  f"{base.memory_limit_gb:.4g} GiB"))
    else:
        done = len(order)
    if progress is not None:
        progress(len(order), len(order))
    if not priced:
        raise ValueError(_nothing_fits(world_size, rows, pinned, refused, needs_over_limit, base.memory_limit_gb))
    ranked = sorted(priced, key=lambda p: (p.step_s, p.memory_bytes, p.config.pp, p.config.num_microbatches))
    timed = [t for t in costs.timed.values() if t is not None]
    threads = threads or torch.get_num_threads()
    how = (f"compute timed here at each layout's shard shapes ({len(timed)} shapes, {threads} thread(s))" if timed
           else f"cost model ({base.hardware})")
    if concurrent is not None and concurrent < world_size:
        how += f", {concurrent} rank(s) computing at once"
    found = LayoutSearch(world_size=world_size, chosen=ranked[0], ranked=tuple(ranked), refused=tuple(refused),
                         seconds=time.perf_counter() - start, costs=how, notes=tuple(costs.notes),
                         pruned=len(order) - done, stopped=stopped)
    if cache and stopped != "budget":  # a search cut short is not the answer to remember
        layout_cache.save(path, key, found)
    return found


def _from_cache(path, key: dict, base: ParallelConfig, world_size: int, rows: int, pinned: Mapping[str, Any],
                start: float) -> LayoutSearch | None:
    """The search read from ``path`` (``layout_cache.load``), its layouts checked against the
    world, the batch and the pins; None (warned) where they do not hold."""
    got = layout_cache.load(path, key, base)
    if got is None:
        return None
    rows_, body = got
    wanted = {k: ScheduleKind.parse(v) if k == "schedule" else v for k, v in pinned.items()}
    for config, *_ in rows_:
        if config.tp * config.pp * config.replicas != world_size or rows % (config.replicas * config.num_microbatches) \
                or any(getattr(config, k) != v for k, v in wanted.items()):
            warnings.warn(f"fxpipe: ignoring the layout search cache {path} (its layout {describe(config)} is not one "
                          f"of this search); searching again", stacklevel=3)
            return None
    ranked = tuple(PricedLayout(config=c, memory_bytes=m, step_s=s, bubble=b, allreduce_s=a) for c, m, s, b, a in rows_)
    return LayoutSearch(world_size=world_size, chosen=ranked[0], ranked=ranked, refused=(),
                        seconds=time.perf_counter() - start, costs=body["costs"],
                        pruned=body["priced"] + body["refused"] + body["pruned"] - len(ranked),
                        cached=f"{path} (searched in {body['seconds']:.1f} s)")


def _bounds(candidates: Sequence[ParallelConfig], rows: int, costs: CaptureCosts, fixed: frozenset[str],
            limit: int | None, concurrent: int | None, refused: list) -> dict[int, float]:
    """Each candidate's lower bound (``layout_bound.py``), by index; 0 where none is known
    (expert parallelism, or a memory saver that changes the timed shapes: sequence
    parallelism); a layout whose shape cannot be compiled is refused here."""
    out: dict[int, float] = {}
    for i, config in enumerate(candidates):
        tries = memory_savers(config, fixed) if limit is not None else [config]
        if config.ep > 1 or any(t.sp != config.sp for t in tries):
            out[i] = 0.0
            continue
        b = rows // (config.replicas * config.num_microbatches)
        try:
            work = costs.work(config, b)
        except (ValueError, PartitionError) as exc:
            refused.append((describe(config), " ".join(str(exc).split())[:200]))
            continue
        out[i] = layout_bound_s(config, work, concurrent)  # no schedule generated per candidate
    return out


_NOT_CUT = "the head is not cut into blocks at this layout: its blockwise loss is the whole head's"


def cache_enabled() -> bool:
    """Whether ``fxpipe run`` and ``fxpipe compile`` remember their searches on disk
    (``FXPIPE_LAYOUT_CACHE=0`` turns it off; ``FXPIPE_CACHE_DIR`` moves it)."""
    return os.environ.get("FXPIPE_LAYOUT_CACHE", "1") != "0"


def report_progress(done: int, total: int) -> None:
    """Progress on a long search, on stderr: a line at each quarter of the layouts."""
    if total and (done == total or done * 4 // total != (done - 1) * 4 // total) and done > 0:
        print(f"fxpipe: layout search: {done}/{total} layouts priced", file=sys.stderr, flush=True)


def _check_ep(ep: int, experts: Sequence[int]) -> None:
    """A pinned ep the graph cannot take, refused by its cause (else every candidate is
    dropped and the refusal blames the world and the batch)."""
    if ep == 1:
        return
    if not experts:
        raise ValueError(f"ep={ep} spreads the experts of grouped mixture-of-experts layers (stacked experts run "
                         f"as grouped matmuls, as transformers' Mixtral and Qwen-MoE run them) over data-parallel "
                         f"ranks, but this model's graph has none; use ep=1")
    if any(n % ep for n in experts):
        raise ValueError(f"ep={ep} must divide the expert count of every MoE layer; this model's have "
                         f"{', '.join(map(str, sorted(set(experts))))} experts: use an ep that divides them")


def _gib(nbytes: float, up: bool = False) -> str:
    """GiB to four significant digits, so a tiny limit or need is not printed as 0.00; ``up``:
    rounded up, so the limit it suggests does fit."""
    x = nbytes / 2**30
    if up and x > 0:
        step = 10.0 ** (math.floor(math.log10(x)) - 3)
        x = math.ceil(x / step) * step
    return f"{x:.4g}"


def _nothing_fits(world_size: int, rows: int, pinned: Mapping[str, Any], refused: list, needs: list[int],
                  limit_gb: float | None) -> str:
    """The refusal: what was asked, the closest layout and the change that makes it fit
    (the limit as given: its bytes, truncated to an integer, would print 1e-06 as 9.993e-07)."""
    asked = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in pinned.items()) or "no pinned field"
    if not refused:
        return (f"no layout of {world_size} ranks honours {asked} for a batch of {rows} rows; dp must divide "
                f"the rows and tp·pp·dp equal the world: unpin a field or change the world size")
    if needs and limit_gb is not None:
        least = min(needs)
        return (f"no layout of {world_size} ranks with {asked} fits {limit_gb:.4g} GiB per rank; the "
                f"smallest needs {_gib(least)} GiB: raise memory_limit_gb to {_gib(least, up=True)}, unpin a "
                f"field, or use more ranks")
    name, why = refused[0]
    return f"no layout of {world_size} ranks with {asked} compiles for this model; e.g. {name}: {why}"
