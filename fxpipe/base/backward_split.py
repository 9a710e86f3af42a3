"""Zero-bubble backward split: input gradients (I) now, weight gradients (W) later,
without computing anything twice.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), §2: the backward of a
stage is two passes — B_input, which the previous stage waits for, and B_weight,
which can fill a bubble later. Re-running ``autograd.backward`` for W re-walks
every node between the loss and the weights (measured 1.64× B on GPT-2 for I + W);
this module splits one autograd graph instead.

Terms, on the autograd graph of one microbatch (nodes are backward functions):

- the **input closure** is every node from which an input leaf's accumulator is
  reachable: exactly the nodes I must run;
- a **boundary** is a node of the input closure (or a root) with an edge to a node
  outside it that leads to a parameter: I runs it for its input-side edges only
  (the engine computes just the outputs its ``inputs`` need), so its weight-side
  edges are still owed;
- the **weight side** is everything reachable from those edges; it cannot reach
  an input leaf (else it would be in the closure), so it is W's own work.

I captures each boundary's incoming gradient with a pre-hook. W then runs each
boundary once more, asking only for its weight-side edges (one engine call per
boundary: with all boundaries in one call the engine would follow their input-side
edges to the next boundary and redo I), and finally pushes the gathered edge
gradients through the weight side into ``.grad`` in one call, so parameter hooks
(fp32 masters) fire as in a fused backward.

A weight-side node reached from two boundaries (a weight used twice in the stage,
e.g. tied embedding and LM head) makes the engine ambiguous: asked for the
gradient arriving at that node from one boundary, it also follows the input-side
path to the other and counts its share twice. Such a boundary is instead applied
directly (its function called on the captured gradient), which recomputes its
input-side output once — the only duplicated work, and only for shared weights.
torch.distributed.pipelining's ``stage_backward_weight`` splits its backward in a
related way (intermediate nodes captured in I, weight gradients from them in W).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Edge = tuple[Node, int]


def _graph(roots: Sequence[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from ``roots`` (discovery order) and each node's parents."""
    order: list[Node] = []
    parents: dict[Node, list[Node]] = {}
    seen: set[Node] = set()
    stack = list(dict.fromkeys(roots))  # two outputs may share a grad_fn
    seen.update(stack)
    while stack:
        node = stack.pop()
        order.append(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return order, parents


def _ancestors(targets: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``targets`` and every node with a path to one of them."""
    found = set(targets)
    stack = list(targets)
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def _as_input(grad: torch.Tensor | None, node: Node, slot: int) -> torch.Tensor | None:
    """What the engine would deliver to ``node``'s input ``slot``: a node applied by hand
    skips the engine's reduction of broadcast gradients and its dtype cast."""
    if grad is None:
        return None
    meta = node._input_metadata[slot]
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    return grad.to(meta.dtype)


@dataclass
class BackwardSplit:
    """One microbatch's backward, run as I then W. Build it after the forward."""

    outputs: Sequence[torch.Tensor]
    grad_outputs: Sequence[torch.Tensor | None]
    inputs: Sequence[torch.Tensor]
    """Leaves whose gradients I returns (the stage's received activations)."""
    params: Sequence[torch.Tensor]
    """Leaves whose ``.grad`` W accumulates."""
    _boundaries: list[tuple[Node, list[tuple[int, Edge]], bool]] = field(default_factory=list, init=False)
    """(node, its weight-side edges by position in ``next_functions``, ambiguous)."""
    _captured: dict[Node, tuple] = field(default_factory=dict, init=False)
    _weight_roots: list[tuple[Edge, torch.Tensor]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        pairs = [(t, g) for t, g in zip(self.outputs, self.grad_outputs) if t.grad_fn is not None]
        self._roots = [(get_gradient_edge(t), g if g is not None else torch.ones_like(t))
                       for t, g in pairs]
        root_nodes = [e.node for e, _ in self._roots]
        nodes, parents = _graph(root_nodes)
        leaves = [get_gradient_edge(t).node for t in self.inputs if t.requires_grad]
        weights = [get_gradient_edge(t).node for t in self.params if t.requires_grad]
        closure = _ancestors([n for n in leaves if n in parents], parents)
        self._weighty = _ancestors([n for n in weights if n in parents], parents)
        self._closure = closure
        found = []
        for node in nodes:  # discovery order: the same on every rank of a TP group
            if node not in closure:
                continue
            edges = [(j, (c, i)) for j, (c, i) in enumerate(node.next_functions)
                     if c is not None and c not in closure and c in self._weighty]
            if edges:
                found.append((node, edges))
        # How many boundary edges reach each weight-side node (the weight side is
        # small away from the first stage: views, casts and accumulators).
        reached: dict[Node, int] = {}
        for _, edges in found:
            for c in self._weight_side({c for _, (c, _) in edges}):
                reached[c] = reached.get(c, 0) + 1
        for node, edges in found:
            shared = any(reached[c] > 1 for c in self._weight_side({c for _, (c, _) in edges}))
            self._boundaries.append((node, edges, shared))
        # Roots outside the closure are wholly W's: their gradient goes straight to W.
        self._outside = [(e, g) for e, g in self._roots if e.node not in closure and e.node in self._weighty]

    def _weight_side(self, start: set[Node]) -> set[Node]:
        seen, stack = set(start), list(start)
        while stack:
            for c, _ in stack.pop().next_functions:
                if c is not None and c not in seen and c in self._weighty:
                    seen.add(c)
                    stack.append(c)
        return seen

    def backward_input(self) -> list[torch.Tensor | None]:
        """Gradients of ``inputs`` (None where unused); weight-side edges left owed."""
        handles = [node.register_prehook(self._capture(node)) for node, _, _ in self._boundaries]
        try:
            wanted = [t for t in self.inputs if t.requires_grad]
            inside = [(e, g) for e, g in self._roots if e.node in self._closure]
            got: Sequence[torch.Tensor | None] = ()
            if wanted and inside:
                got = torch.autograd.grad([e for e, _ in inside], wanted, [g for _, g in inside],
                                          retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        by_leaf = dict(zip(map(id, wanted), got)) if wanted and inside else {}
        return [by_leaf.get(id(t)) for t in self.inputs]

    def _capture(self, node: Node):
        def hook(grad_outputs: tuple) -> None:
            self._captured[node] = grad_outputs
        return hook

    def owed(self) -> list[tuple | None]:
        """What I captured for W, by boundary in discovery order, taken out of this split:
        a recomputed region (``ir/recompute_region.py``) keeps these instead of its graph
        and hands them to the split of its rerun (``owe``)."""
        out = [self._captured.pop(node, None) for node, _, _ in self._boundaries]
        self._captured.clear()
        return out

    def owe(self, captured: Sequence[tuple | None]) -> None:
        """Take over another split's ``owed`` as this one's I: the same graph rebuilt (a
        rerun of the same ops discovers its boundaries in the same order)."""
        if len(captured) != len(self._boundaries):
            raise RuntimeError(f"a rerun found {len(self._boundaries)} weight-gradient boundaries where the first "
                               f"run found {len(captured)}: the recomputed graph is not the one first run")
        self._captured = {node: grads for (node, _, _), grads in zip(self._boundaries, captured) if grads is not None}

    def backward_weight(self) -> None:
        """Accumulate the parameters' gradients; frees the graph."""
        owed: dict[Edge, torch.Tensor] = {}
        for node, edges, shared in self._boundaries:
            grads = self._captured.pop(node, None)
            if grads is None:  # no gradient reached this node in I
                continue
            outs = [(GradientEdge(node, k), g) for k, g in enumerate(grads) if g is not None]
            if not outs:
                continue
            if shared:
                with torch.no_grad():  # a Python Function's node (a recomputed region) is not callable
                    every = node(*grads) if callable(node) else node.apply(*grads)
                every = every if isinstance(every, tuple) else (every,)
                got = [_as_input(every[j], c, i) for j, (c, i) in edges]
            else:
                unique = list(dict.fromkeys(e for _, e in edges))  # mul(w, w): one target
                one = torch.autograd.grad([e for e, _ in outs], [GradientEdge(c, i) for c, i in unique],
                                          [g for _, g in outs], retain_graph=True, allow_unused=True)
                first = {e: k for k, (_, e) in reversed(list(enumerate(edges)))}
                got = [dict(zip(unique, one))[e] if first[e] == k else None
                       for k, (_, e) in enumerate(edges)]
            for (_, edge), g in zip(edges, got):
                if g is not None:
                    owed[edge] = owed[edge] + g if edge in owed else g
        roots = [(GradientEdge(c, i), g) for (c, i), g in owed.items()] + list(self._outside)
        if roots:
            torch.autograd.backward([e for e, _ in roots], [g for _, g in roots],
                                    inputs=[p for p in self.params if p.requires_grad])
        self._boundaries.clear()
        self._outside = []
