"""A rewrite of a Program's graph that adds nodes and re-costs: the copy it edits and
the Program it returns (``split_matmul`` and ``split_loss``, which both add blocks).

Passes never mutate the Program they receive (``ir/program.py``): the graph is deep-copied,
the per-node maps copied so new nodes can be given a module path and a layer, and the
result is linted, recompiled and costed again, since the nodes it costed are gone."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch.fx as fx

from fxpipe.ir.program import Program
from fxpipe.passes.cost import cost_pass


@dataclass
class GraphEdit:
    """The pass's own copy of the graph and of its per-node maps, edited in place."""
    gm: fx.GraphModule
    by_name: dict[str, fx.Node]
    """The copy's nodes as the rewrite found them, by name."""
    paths: dict[str, str]
    """``Program.module_paths``: a new node takes the path of what it replaces."""
    layers: dict[str, int]
    """``Program.layers``, likewise."""

    @staticmethod
    def of(program: Program) -> "GraphEdit":
        gm = copy.deepcopy(program.graph_module)
        return GraphEdit(gm, {n.name: n for n in gm.graph.nodes}, dict(program.module_paths),
                         dict(program.layers))

    def recosted(self, program: Program, **records) -> Program:
        """``program`` with the edited graph and maps, costed again; ``records``: the
        Program fields the rewrite extends (``matmul_splits=...``)."""
        self.gm.graph.lint()
        self.gm.recompile()
        return cost_pass(program.replace(graph_module=self.gm, module_paths=self.paths, layers=self.layers,
                                         costs={}, **records))

    def pruned(self, program: Program) -> Program:
        """``program`` with the edited graph less what nothing reads any more (the nodes a
        rewrite bypassed) and their entries in the maps; costed again if ``program`` was
        (a pass before the cost pass leaves that to it)."""
        self.gm.graph.eliminate_dead_code()
        live = {n.name for n in self.gm.graph.nodes}
        self.paths = {k: p for k, p in self.paths.items() if k in live}
        self.layers = {k: i for k, i in self.layers.items() if k in live}
        if program.costs:
            return self.recosted(program)
        self.gm.graph.lint()
        self.gm.recompile()
        return program.replace(graph_module=self.gm, module_paths=self.paths, layers=self.layers)
