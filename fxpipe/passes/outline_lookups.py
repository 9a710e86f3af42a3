"""Embedding lookups of a row-split table, done by the rows' owners (used by ``vocab_rows``).

A tied table's first stage reads every row through ``aten.embedding``, so without this
the first pipeline rank holds, updates and checkpoints the whole V×h table while the
head's rows are spread over the ranks (and those rows' gradients are summed between the
first rank and their owners). Megatron's vocabulary-parallel embedding (Shoeybi et al.
2019 §3) splits the lookup over tensor-parallel ranks: each looks the ids up in its rows,
ids outside them read zeros, and an all-reduce sums the parts. Here the parts come from
pipeline ranks instead (Yeung et al., MLSys 2025, arXiv 2411.05288): every rank reads
the batch, so each owner can look the microbatch's ids up in its rows and send its
part to the stage that reads the sum (``runtime/lookup_exchange.py``). The stage graph reads the result as an input instead
of computing it, and the rows of a tied table and of its head coincide on each owner,
so the tied gradient sum becomes local.

Recognised by structure: ``aten.embedding(w, ids)`` (no ``scale_grad_by_freq``, not
sparse) whose ``ids`` are a batch input through value-preserving ops (views, copies),
where ``w`` is a trainable parameter placeholder. Under tensor parallelism the lookup is
the TP pass's ``fxpipe_tp.vocab_parallel_embedding(w, ids, padding_idx)`` of the TP
rank's rows, whose partial result the stage then sums over the TP group: the owners
(pipeline ranks of that TP rank) compute that partial result instead, so the two
reductions compose (pipeline ranks by the lookup, TP ranks by the stage, as before).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.fx as fx

from fxpipe.ir.op_tables import VALUE_PRESERVING
from fxpipe.ir.program import TensorSpec
from fxpipe.ir.stage_plan import PipelinePlan, Stage, VocabLookup
from fxpipe.ir.subgraph import copy_subgraph
from fxpipe.tp.ops import OPS

aten = torch.ops.aten


def lookup_of(user: fx.Node, table: fx.Node, batch: dict[fx.Node, int]) -> tuple[int, list[fx.Node]] | None:
    """(batch input index, the value-preserving ops from it to the ids, in order) when
    ``user`` is an embedding lookup of ``table`` by token ids read from the batch."""
    if user.op != "call_function" or not user.args or user.args[0] is not table or user.kwargs:
        return None
    if user.target is OPS.vocab_parallel_embedding.default:  # (weight, ids, padding_idx)
        args = list(user.args)
    elif user.target is aten.embedding.default:
        args = list(user.args) + [-1, False, False][len(user.args) - 2:]
        if args[3] or args[4]:
            return None  # frequency-scaled or sparse gradients: each owner would count differently
    else:
        return None
    if table in args[1:]:
        return None
    chain: list[fx.Node] = []
    node = args[1]
    while isinstance(node, fx.Node) and node not in batch:
        if node.op != "call_function" or node.target not in VALUE_PRESERVING or node.all_input_nodes != [node.args[0]]:
            return None
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    return batch[node], chain[::-1]


def stage_lookups(stage: Stage, table_names: dict[str, str]) -> dict[str, list[tuple[fx.Node, int, list[fx.Node]]]]:
    """Canonical table name -> its lookups in ``stage``'s graph: (embedding node, batch
    index, ids ops). ``table_names``: the stage's parameter name -> canonical, for the
    tables considered."""
    placeholders = [n for n in stage.graph_module.graph.nodes if n.op == "placeholder"]
    params = placeholders[:len(stage.params)]
    batch = {placeholders[len(stage.params) + k]: i for k, i in enumerate(stage.batch_inputs)}
    out: dict[str, list[tuple[fx.Node, int, list[fx.Node]]]] = {}
    for node, name in zip(params, stage.params):
        if name not in table_names:
            continue
        for user in node.users:
            found = lookup_of(user, node, batch)
            if found is not None:
                out.setdefault(table_names[name], []).append((user, *found))
    return out


def is_lookup(user: fx.Node, table: fx.Node, stage: Stage) -> bool:
    placeholders = [n for n in stage.graph_module.graph.nodes if n.op == "placeholder"]
    batch = {placeholders[len(stage.params) + k]: i for k, i in enumerate(stage.batch_inputs)}
    return lookup_of(user, table, batch) is not None


def outline_lookups(plan: PipelinePlan, stage: int, tables: Sequence[str]) -> tuple[PipelinePlan, list[VocabLookup]]:
    """Stage ``stage`` reads each lookup of ``tables`` as an input (after its received
    values) instead of computing it; a table placeholder left unread is dropped from the
    stage. The stage's graph must be a copy the caller owns (it is edited in place)."""
    st = plan.stages[stage]
    canon = plan.canonical
    gm = st.graph_module
    graph = gm.graph
    found = stage_lookups(st, {p: canon[p] for p in st.params if canon[p] in tables})
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1]
    made: list[VocabLookup] = []
    for table in sorted(found):
        for node, batch_index, chain in found[table]:
            ids_graph, out = copy_subgraph([chain[0].args[0] if chain else node.args[1]], chain,
                                           [chain[-1] if chain else node.args[1]])
            out.args = (out.args[0][0],)  # the ids themselves, not a 1-tuple
            val = node.meta["val"]
            padding = node.args[2] if len(node.args) > 2 else -1
            made.append(VocabLookup(name=node.name, table=table, stage=stage, batch_input=batch_index,
                                    ids=fx.GraphModule(torch.nn.Module(), ids_graph),
                                    spec=TensorSpec(tuple(int(d) for d in val.shape), val.dtype),
                                    padding_idx=int(padding),
                                    vocab_parallel=node.target is OPS.vocab_parallel_embedding.default))
            with graph.inserting_after(last):
                ph = graph.placeholder(f"{node.name}_lookup")
            ph.meta = {"val": val}
            last = ph
            node.replace_all_uses_with(ph)
            graph.erase_node(node)
            for op in reversed(chain):  # the ids' views, unless something else reads them
                if not op.users:
                    graph.erase_node(op)
    keep = []
    for node, name in zip(placeholders[:len(st.params)], st.params):
        if canon[name] in tables and not node.users:
            graph.erase_node(node)
        else:
            keep.append(name)
    gm.recompile()
    stages = list(plan.stages)
    stages[stage] = dataclasses.replace(st, params=tuple(keep), lookups=tuple(lk.name for lk in made))
    still = {canon[p] for p in keep}
    param_stages = {n: tuple(s for s in ss if s != stage or n in still) for n, ss in plan.param_stages.items()}
    return dataclasses.replace(plan, stages=tuple(stages), param_stages=param_stages), made
