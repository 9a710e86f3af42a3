"""After the split: each pipeline rank holds only the rows of a parameter its stages read.

``split_matmul_pass`` cuts a heavy vocabulary projection into row blocks that the
partitioner spreads over stages, but each block is a ``slice`` of the whole weight,
so every stage holding a block would hold, update, checkpoint and all-reduce the whole
V×h tensor, and the backward of its slice builds a whole-weight gradient (on HF
GPT-2's 50257×256 head, summed busy time over two stages was 27% above one process;
docs/costs.md). Yeung et al. (MLSys 2025, arXiv 2411.05288) partition the vocabulary
layers over the pipeline devices instead; this pass does it by graph structure:

- a trainable parameter that a stage reads only through dim-0 slices
  (``aten.slice.Tensor(w, 0, a, b)``, step 1) needs only those rows on that stage;
- a pipeline rank holds the union of its stages' rows (every row where one of its
  stages reads the tensor otherwise: a tied embedding lookup), recorded as
  ``PipelineRows`` in ``PipelinePlan.row_shards``;
- each stage graph's slice is rebased onto the rank's rows, and its placeholder's
  fake value gets the rank's local shape, so the slice backward builds a gradient of
  the rank's rows only.

The parameter is then a pipeline-sharded tensor like a TP shard (``sharding.compose``:
the runtime builds, checkpoints and exports only each rank's rows). Rows that several
ranks hold (a tied embedding on the first stage and head rows on the last) leave
``tied_stages``: their gradients are summed per row range over exactly the ranks that
hold them (``runtime/grad_sync.py``), not as one whole-tensor all-reduce.
A parameter that tensor parallelism splits along another dim than 0 is left alone.

The embedding lookup of such a table (``aten.embedding`` of batch token ids, or under
TP the vocabulary-parallel lookup of a TP rank's rows) is done by the rows' owners
(``passes/outline_lookups.py``): a tied table's rows are then its
head's rows on each rank (a head reading it whole on the last rank holds it alone), and
an untied table is split evenly where the head is split; the consuming stage reads the
owners' summed lookup as an input and its rank holds only the rows it owns.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.program import ParamKind
from fxpipe.ir.shard_spec import PipelineRows, ShardKind, ShardSpec, ranges_of
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.passes.outline_lookups import is_lookup, outline_lookups, stage_lookups

aten = torch.ops.aten


def _row_slice(user: fx.Node, node: fx.Node, rows: int) -> tuple[int, int] | None:
    """(start, stop) if ``user`` is ``node[a:b]`` along dim 0 with step 1, else None."""
    if user.op != "call_function" or user.target is not aten.slice.Tensor or user.args[0] is not node:
        return None
    args = list(user.args) + [None] * (5 - len(user.args))
    dim, start, stop, step = args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0), args[2], args[3], args[4]
    ndim = node.meta["val"].dim()
    if not isinstance(dim, int) or dim % ndim != 0 or step not in (None, 1):
        return None
    if not all(x is None or isinstance(x, int) for x in (start, stop)):
        return None
    start = 0 if start is None else (start + rows if start < 0 else start)
    stop = rows if stop is None else (stop + rows if stop < 0 else stop)
    start, stop = max(0, min(start, rows)), max(0, min(stop, rows))
    return (start, stop) if stop > start else None


def _stage_reads(plan: PipelinePlan, stage: int, rows_of: Mapping[str, int],
                 lookups: bool = False) -> dict[str, set[int] | None]:
    """Canonical name -> rows stage ``stage`` reads (None: the whole tensor). With
    ``lookups``, an embedding lookup by batch token ids reads no rows (its owners do it:
    ``passes/outline_lookups.py``)."""
    canon = plan.canonical
    st = plan.stages[stage]
    placeholders = [n for n in st.graph_module.graph.nodes if n.op == "placeholder"][:len(st.params)]
    out: dict[str, set[int] | None] = {}
    for node, name in zip(placeholders, st.params):
        c = canon[name]
        if c not in rows_of:
            continue
        rows: set[int] | None = set()
        for user in node.users:
            ab = _row_slice(user, node, rows_of[c])
            if ab is None and lookups and is_lookup(user, node, st):
                continue
            if ab is None:
                rows = None
                break
            rows.update(range(*ab))
        prev = out.get(c, set())
        out[c] = None if rows is None or prev is None else prev | rows
    return out


def _rebase(plan: PipelinePlan, stage: int, rows: PipelineRows, pp_rank: int) -> None:
    """Point stage ``stage``'s slices of ``rows.name`` at the rank's local rows."""
    canon = plan.canonical
    st = plan.stages[stage]
    gm = st.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][:len(st.params)]
    local = rows.local_rows(pp_rank)
    for node, name in zip(placeholders, st.params):
        if canon[name] != rows.name:
            continue
        for user in list(node.users):
            ab = _row_slice(user, node, rows.rows)
            if ab is None:  # a whole read: the rank holds every row, nothing to rebase
                assert local == rows.rows
                continue
            start = rows.offset(pp_rank, ab[0])
            user.args = (node, 0, start, start + ab[1] - ab[0])
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.shape[0] != local:
            with detect_fake_mode([val]) or torch._subclasses.fake_tensor.FakeTensorMode():
                node.meta["val"] = val.new_empty((local, *val.shape[1:]))
    gm.recompile()


def vocab_rows_pass(plan: PipelinePlan, ctx: CompileContext) -> PipelinePlan:
    """Each pipeline rank holds only the rows it reads (``hold_vocab_rows``); under the
    vocabulary passes a head parameter some stage also reads whole is refused, as every
    rank must hold exactly its block."""
    out = hold_vocab_rows(plan, ctx.schedule.stage_ranks, plan.program.tp_specs, tp=ctx.config.tp)
    head = out.vocab_head
    for name in head.params if head is not None else ():
        held = out.row_shards[name].ranks if name in out.row_shards else None
        if held != tuple(((a, b),) for a, b in head.blocks):
            raise ValueError(f"vocab_passes=True: the head's parameter {name!r} is also read whole by a "
                             f"stage (rows held per rank: {held}); use vocab_passes=False for this model")
    return out


def hold_vocab_rows(plan: PipelinePlan, stage_ranks: Sequence[int], specs: Mapping[str, ShardSpec],
                    tp: int = 1) -> PipelinePlan:
    """Give every pipeline rank only the rows it reads of each row-sliced parameter
    (module docstring). ``stage_ranks[s]``: the pipeline rank running stage s;
    ``specs``: the tensor-parallel specs (a parameter split along dim > 0 stays whole);
    ``tp``: the tensor-parallel size. Under tp > 1 only a parameter TP splits along its
    rows is split further: a replicated one would need one row set per TP rank in its
    spec, which the shard contract's composition does not build, so it stays whole."""
    program = plan.program
    pp = max(stage_ranks) + 1 if stage_ranks else 1
    if pp < 2:
        return plan
    rows_of = {}
    for p in program.params:
        spec = specs.get(p.canonical)
        if p.kind is ParamKind.PARAMETER and p.requires_grad and p.shape and \
                (spec is not None and spec.kind is not ShardKind.REPLICATED and spec.dim == 0 or
                 tp == 1 and (spec is None or spec.kind is ShardKind.REPLICATED)):
            rows_of[p.canonical] = p.shape[0]
    held = _held(plan, stage_ranks, rows_of, pp, lookups=False)
    head = plan.vocab_head  # the LM head cut off the last stage: rank r reads its block r (of weight and bias)
    blocks = {p: [set(range(a, b)) for a, b in head.blocks] for p in head.params} if head is not None else {}
    _add(held, blocks, pp)
    # Under tp > 1 the lookups are the TP pass's vocabulary-parallel ones, of each TP
    # rank's rows: the owners split those further (passes/outline_lookups.py).
    looked = _lookup_stages(plan, rows_of)
    sub = {c: rows_of[c] for c in looked}
    with_lookups = _held(plan, stage_ranks, sub, pp, lookups=True)
    _add(with_lookups, {c: b for c, b in blocks.items() if c in looked}, pp)
    others_split = any(_splits(r, rows_of[n]) for n, r in held.items() if n not in looked)
    for c in list(looked):
        per_rank = with_lookups[c]  # what its other reads need: a tied head's blocks, or all of it
        consumer = stage_ranks[min(looked[c])]
        if len(per_rank[consumer]) == rows_of[c] or not (any(per_rank) or others_split):
            # The consuming rank holds every row anyway (its head), or nothing else is
            # split (an untied table alone): the lookup stays in the stage.
            del looked[c]
            continue
        held[c] = _owners(per_rank, rows_of[c], consumer, any(per_rank))
    row_shards = {}
    for c, per_rank in sorted(held.items()):
        if c not in looked and not _splits(per_rank, rows_of[c]):
            continue  # every holder needs the whole tensor: nothing to split
        row_shards[c] = PipelineRows(name=c, rows=rows_of[c], ranks=tuple(ranges_of(sorted(r)) for r in per_rank))
    if not row_shards:
        return plan
    stages = tuple(dataclasses.replace(st, graph_module=fx.GraphModule(st.graph_module, _copy(st.graph_module)))
                   for st in plan.stages)
    plan = dataclasses.replace(plan, stages=stages)
    made = []
    for s in sorted({s for ss in looked.values() for s in ss}):
        plan, found = outline_lookups(plan, s, sorted(c for c, ss in looked.items() if s in ss))
        made += found
    for s in range(plan.num_stages):
        for c in _stage_reads(plan, s, {c: rows_of[c] for c in row_shards}):
            _rebase(plan, s, row_shards[c], stage_ranks[s])
    tied = {n: s for n, s in plan.tied_stages.items() if n not in row_shards}
    return dataclasses.replace(plan, tied_stages=tied, row_shards=row_shards, lookups=tuple(made))


def _held(plan: PipelinePlan, stage_ranks: Sequence[int], rows_of: Mapping[str, int], pp: int,
          lookups: bool) -> dict[str, list[set[int]]]:
    """Canonical name -> per pipeline rank, the rows its stages read."""
    held: dict[str, list[set[int]]] = {}
    for s in range(plan.num_stages):
        for c, rows in _stage_reads(plan, s, rows_of, lookups).items():
            per_rank = held.setdefault(c, [set() for _ in range(pp)])
            per_rank[stage_ranks[s]] |= set(range(rows_of[c])) if rows is None else rows
    return held


def _add(held: dict[str, list[set[int]]], blocks: Mapping[str, list[set[int]]], pp: int) -> None:
    """Add rows each rank reads outside its stage graphs (the vocabulary passes' blocks)."""
    for c, per_rank in blocks.items():
        mine = held.setdefault(c, [set() for _ in range(pp)])
        for r, rows in enumerate(per_rank):
            mine[r] |= rows


def _splits(per_rank: Sequence[set[int]], rows: int) -> bool:
    """Whether some rank holds part of the rows, not all or none of them."""
    return not all(len(r) in (0, rows) for r in per_rank)


def _lookup_stages(plan: PipelinePlan, rows_of: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Canonical table name -> the stages looking it up by batch token ids."""
    canon = plan.canonical
    out: dict[str, list[int]] = {}
    for s, st in enumerate(plan.stages):
        for c in stage_lookups(st, {p: canon[p] for p in st.params if canon[p] in rows_of}):
            out.setdefault(c, []).append(s)
    return {c: tuple(ss) for c, ss in out.items()}


def _owners(per_rank: list[set[int]], rows: int, consumer: int, sliced: bool) -> list[set[int]]:
    """The rows each rank holds once the lookups are done by the owners. A tied table
    (``sliced``: the head reads rows of it on some ranks, its blocks or all of it) keeps
    the head's rows, so each owner's table rows are its head rows (the tied sum is
    local); rows the head does not read go to the rank consuming the lookup. An untied table is split evenly over
    the ranks (Yeung et al.'s even vocabulary partition)."""
    pp = len(per_rank)
    if not sliced:
        return [set(range(p * rows // pp, (p + 1) * rows // pp)) for p in range(pp)]
    out = [set(r) for r in per_rank]
    out[consumer] |= set(range(rows)) - set().union(*per_rank)
    return out


def _copy(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm``'s graph (node metadata included), so the input plan is unchanged."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return graph
