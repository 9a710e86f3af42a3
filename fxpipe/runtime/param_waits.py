"""ZeRO-1's parameter broadcast behind the first forward (Megatron-LM's
``--overlap-param-gather``): each parameter is waited for just before the first op of
the stage that reads it, not all of them before the stage starts.

A stage is one captured graph taking every parameter as an input, so the runtime cannot
start it on part of them from outside. It can from inside: this rank's copy of each
stage graph gets, before the first reader of each broadcast parameter, a call
``ParamWaits.ready(param, name)`` that waits for that parameter's collective (and copies
it out of its coalescing buffer) and returns the tensor itself, so autograd sees the
same leaf. The owners broadcast in the order the stages first read the tensors, so the
first layer's arrive first and the last layers' travel while the first compute. After
the step's first forward a wait is a dictionary lookup per parameter and microbatch.

A table whose rows this rank looks up for another stage (``runtime/lookup_exchange.py``)
is waited for before its first lookup, which comes first. Not used where the
vocabulary passes' head blocks read the LM head outside the stage graphs, nor where
Inductor compiles the stages (the compiled graph is opaque): there every parameter is
waited for before the first forward computes (``runtime/zero.py``).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.fx as fx

from fxpipe.ir.stage_plan import Stage
from fxpipe.runtime.zero import PendingBroadcast


class ParamWaits:
    """The waits of one rank's stages; ``pending`` is the step's broadcast (None between
    steps); ``order``: the parameters in the order the stages first read them, the order
    the owners broadcast them in."""

    def __init__(self, order: Sequence[str]) -> None:
        self.pending: PendingBroadcast | None = None
        self.order = tuple(order)

    def ready(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Called by the stage graph before the first reader of parameter ``name``."""
        self.wait_for(name)
        return tensor

    def wait_for(self, name: str) -> None:
        """Before tensor ``name`` is read outside a stage graph (a table's owned rows)."""
        if self.pending is not None:
            self.pending.wait_for(name)


def with_param_waits(stage: Stage, canonical: Mapping[str, str], broadcast: set[str],
                     waits: ParamWaits) -> fx.GraphModule:
    """A copy of ``stage``'s GraphModule that calls ``waits.ready`` before the first reader
    of each parameter in ``broadcast`` (canonical names)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(stage.graph_module.graph, {}))
    for node, param, first, _ in _first_readers(graph, stage.params):
        name = canonical[param]
        if name not in broadcast or first is None:
            continue
        with graph.inserting_before(first):
            waited = graph.call_function(waits.ready, (node, name))
        node.replace_all_uses_with(waited, delete_user_cb=lambda user, w=waited: user is not w)
    return fx.GraphModule(stage.graph_module, graph)


def first_read_order(stages: Sequence[Stage], canonical: Mapping[str, str]) -> list[str]:
    """Canonical parameter names in the order this rank's stages first read them: stage
    by stage (a rank's stages run their first forwards in index order), within a stage
    by the position of each parameter's first reader in its graph."""
    order: dict[str, None] = {}
    for stage in stages:
        for _, param, _, at in sorted(_first_readers(stage.graph_module.graph, stage.params), key=lambda r: r[3]):
            order.setdefault(canonical[param], None)
    return list(order)


def _first_readers(graph: fx.Graph, params: Sequence[str]) -> list[tuple[fx.Node, str, fx.Node | None, int]]:
    """(placeholder, parameter, its first reader in graph order or None, that reader's
    position: past the last node for None) for the graph's leading placeholders, which
    are the stage's parameters in ``params`` order."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    out = []
    for node, param in zip(list(graph.find_nodes(op="placeholder"))[:len(params)], params):
        first = min(node.users, key=position.__getitem__) if node.users else None
        out.append((node, param, first, position[first] if first is not None else len(position)))
    return out
