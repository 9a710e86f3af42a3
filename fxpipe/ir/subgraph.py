"""Copy a set of nodes out of an FX graph into a graph of their own, and the values
that cross the boundary of such a set."""
from __future__ import annotations

from typing import Sequence

import torch.fx as fx


def copy_subgraph(inputs: Sequence[fx.Node], body: Sequence[fx.Node],
                  outputs: Sequence) -> tuple[fx.Graph, fx.Node]:
    """A new graph reading one placeholder per ``inputs`` node (name and meta kept),
    running copies of ``body`` in the given order and returning ``outputs`` (nodes of
    ``body`` or ``inputs``; anything else, e.g. None, passes through). Returns the graph
    and its output node. Used to outline recompute regions and to cut a compiled
    backward into its I and W halves."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in body:
        env[n] = g.node_copy(n, lambda a: env[a])
    out = g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return g, out


def boundary(nodes: Sequence[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The values a set of nodes reads from outside (first-use order) and those of its
    nodes read outside it (graph order): the inputs and outputs of an outlined region
    (recompute regions, autocast regions)."""
    members = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    return inputs, [n for n in nodes if any(u not in members for u in n.users)]
