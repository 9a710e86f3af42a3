"""Zero-bubble I/W split of a compiled stage's backward: two Inductor graphs, no work twice.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), §2: a stage's backward is
B_input (I: the gradients of its received activations, which the previous stage waits
for) and B_weight (W: the parameter gradients, which can fill a bubble later). The eager
split (``base/backward_split.py``) cuts the autograd graph; a compiled stage's whole
backward is one autograd node, which that split cannot cut. So the cut is made one level
down, in the backward FX graph AOTAutograd hands to Inductor:

- **I** is every node an activation gradient depends on (its ancestors), compiled as one
  graph that returns those gradients plus the values it computed that W also reads
  (the *carried* values, e.g. a layer's output gradient ``dY`` that ``dW = dY^T X`` needs);
- **W** is every other node a parameter gradient depends on, compiled as a second graph
  reading the carried values and the saved tensors only it needs.

Each node lands in exactly one of the two, so I + W does B's arithmetic once (the ZB
paper's W is likewise "the remaining part of B"). The cut is made by graph structure
alone, so every rank of a TP group cuts its identical graph identically and the
collectives (``torch.ops.fxpipe_tp.*``) in each half keep one order on every rank.

At run time the compiled backward (called by AOTAutograd's autograd node) runs I and,
while a ``WeightQueue`` is deferring (the StageRunner's I half), returns no parameter
gradients and queues W instead; otherwise (B) it runs W at once and returns everything,
so B still costs one backward. W's gradients later go through the autograd node's own
edges into the parameters (``accumulate``), so AccumulateGrad and the parameters'
post-accumulate hooks (fp32 masters, ``runtime/mixed_precision.py``) run as in a fused backward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.autograd.graph import GradientEdge

from fxpipe.ir.subgraph import copy_subgraph


class CannotSplit(Exception):
    """This backward graph is compiled whole; the message says why."""


# ---- the graph split ------------------------------------------------------------------
@dataclass
class GraphSplit:
    backward: fx.GraphModule
    """The backward graph as AOTAutograd made it (never compiled itself: tests compare
    it with the halves)."""
    input_graph: fx.GraphModule
    """I: every placeholder of the backward; returns the input gradients, then ``carried``."""
    weight_graph: fx.GraphModule
    """W: placeholders ``kept`` then the carried values; returns the parameter gradients."""
    kept: list[int]
    """Indices of the backward's placeholders W reads."""
    carried: list[fx.Node]
    """Nodes of I whose values W reads (nodes of the original backward graph)."""
    num_inputs: int
    num_weights: int
    """Outputs of W: one per input of the compiled function before the received inputs."""


def _ancestors(roots: Sequence, stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Compute nodes (not placeholders) that ``roots`` depend on, without entering ``stop``."""
    found: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in found or n in stop or n.op == "placeholder":
            continue
        found.add(n)
        stack.extend(n.all_input_nodes)
    return found


def _check_splittable(nodes: list[fx.Node], used: set[fx.Node]) -> None:
    """Raise ``CannotSplit`` where cutting by data dependences alone would be wrong."""
    for n in nodes:
        if n.op != "call_function":
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            raise CannotSplit(f"the backward mutates a tensor ({n.target})")  # order is not data flow
        if "with_effects" in str(n.target):
            raise CannotSplit("the backward has ordered side effects (effect tokens)")
        if n not in used and n.is_impure():
            raise CannotSplit(f"side-effecting node {n.name} feeds no gradient")


def _subgraph(gm: fx.GraphModule, inputs: list[fx.Node], body: list[fx.Node],
              outputs: list, visible: bool) -> fx.GraphModule:
    """A new graph of ``body`` (original order) reading ``inputs`` and returning ``outputs``."""
    g, out = copy_subgraph(inputs, body, outputs)
    # compile_fx_backward marks the gradients user-visible (their strides are kept).
    out.meta["user_visible_output_idxs"] = [i for i, o in enumerate(outputs) if isinstance(o, fx.Node)] \
        if visible else []
    return fx.GraphModule(gm, g)


def split_backward(gm: fx.GraphModule, num_inputs: int) -> GraphSplit:
    """Cut AOTAutograd's backward graph ``gm``, whose last ``num_inputs`` outputs are the
    stage's input (activation) gradients and the others its parameters' gradients."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = nodes[-1]
    outs = list(out_node.args[0])
    if not 0 < num_inputs < len(outs):
        raise CannotSplit(f"{len(outs)} gradients for {num_inputs} received inputs")
    in_outs, w_outs = outs[-num_inputs:], outs[:-num_inputs]
    if not any(isinstance(o, fx.Node) for o in in_outs):
        raise CannotSplit("no input gradient")
    input_side = _ancestors(in_outs)
    weight_side = _ancestors(w_outs, stop=input_side)
    _check_splittable(nodes, input_side | weight_side)
    if not any(n.op == "call_function" for n in weight_side):
        raise CannotSplit("no weight-gradient work outside the input-gradient path")
    # get_attr constants are copied to each half that reads them rather than carried.
    consts = {n for n in input_side if n.op == "get_attr"}
    weight_body = set(weight_side) | {a for n in weight_side for a in n.all_input_nodes if a in consts} \
        | {o for o in w_outs if o in consts}
    read_by_w = {a for n in weight_side for a in n.all_input_nodes} | {o for o in w_outs if isinstance(o, fx.Node)}
    carried = [n for n in nodes if n in input_side and n in read_by_w and n not in consts]
    kept = [i for i, p in enumerate(placeholders) if p in read_by_w]
    visible = bool(out_node.meta.get("user_visible_output_idxs"))
    i_graph = _subgraph(gm, placeholders, [n for n in nodes if n in input_side],
                        in_outs + carried, visible)
    w_graph = _subgraph(gm, [placeholders[i] for i in kept] + carried,
                        [n for n in nodes if n in weight_body], w_outs, visible)
    return GraphSplit(gm, i_graph, w_graph, kept, carried, num_inputs, len(w_outs))


class Splitter:
    """``inner_compile`` for ``compile_fx``: forwards go to ``inner`` (Inductor's
    ``compile_fx_inner``) as they are; the backward is cut (``split_backward``) and its
    halves compiled by ``inner`` one by one, or compiled whole with ``reason`` set."""

    def __init__(self, num_inputs: int, inner: Callable) -> None:
        self.num_inputs, self.inner = num_inputs, inner
        self.queue = WeightQueue()
        self.enabled = True
        self.reason: str | None = "the backward was not compiled with the forward"
        self.parts: GraphSplit | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence, **kw):
        if not kw.get("is_backward") or not self.enabled:
            return self.inner(gm, example_inputs, **kw)
        try:
            parts = split_backward(gm, self.num_inputs)
        except CannotSplit as exc:
            self.reason = str(exc)
            return self.inner(gm, example_inputs, **kw)
        static = set(kw.get("static_input_idxs") or ())
        w_kw = dict(kw, static_input_idxs=[j for j, i in enumerate(parts.kept) if i in static])
        w_examples = [example_inputs[i] for i in parts.kept] + [n.meta["val"] for n in parts.carried]
        input_fn = self.inner(parts.input_graph, example_inputs, **kw)
        weight_fn = self.inner(parts.weight_graph, w_examples, **w_kw)
        self.reason, self.parts = None, parts
        return SplitBackward(input_fn, weight_fn, parts.kept, self.num_inputs, parts.num_weights, self.queue)


def count_ops(gm: fx.GraphModule, names: Sequence[str] = ("mm", "addmm", "bmm")) -> int:
    """Calls of ``aten.<name>`` in ``gm`` (tests count matmuls to show none runs twice)."""
    wanted = {getattr(torch.ops.aten, n).default for n in names}
    return sum(n.op == "call_function" and n.target in wanted for n in gm.graph.nodes)


# ---- run time -------------------------------------------------------------------------
@dataclass
class WeightQueue:
    """Where the compiled backward leaves W while the StageRunner runs I."""
    deferring: bool = False
    pending: list[Callable[[], list]] = field(default_factory=list)

    @contextlib.contextmanager
    def defer(self) -> Iterator[None]:
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def take(self) -> list[Callable[[], list]]:
        out, self.pending = self.pending, []
        return out


class _Once:
    """W's graph with its arguments; runs once, then drops them (saved tensors freed)."""

    def __init__(self, fn: Callable, args: list) -> None:
        self.fn, self.args = fn, args

    def __call__(self) -> list:
        args, self.args = self.args, None
        assert args is not None, "W ran twice"
        return list(self.fn(args))


@dataclass
class SplitBackward:
    """The compiled backward as I then W (boxed: called with one list, as AOTAutograd does)."""
    input_fn: Callable
    weight_fn: Callable
    kept: list[int]
    num_inputs: int
    num_weights: int
    queue: WeightQueue
    _boxed_call: bool = True

    def __call__(self, args: list) -> list:
        w_args = [args[i] for i in self.kept]  # before I: compiled code empties its list
        outs = list(self.input_fn(args))
        grads_in, carried = outs[:self.num_inputs], outs[self.num_inputs:]
        weight = _Once(self.weight_fn, w_args + carried)
        if self.queue.deferring:
            self.queue.pending.append(weight)
            return [None] * self.num_weights + grads_in
        return weight() + grads_in


def compiled_node(outputs: Sequence[torch.Tensor]) -> torch.autograd.graph.Node:
    """AOTAutograd's backward node under a compiled stage's outputs (output views and the
    loss scaling sit between them)."""
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        if node.name().endswith("CompiledFunctionBackward"):
            return node
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    raise RuntimeError("no compiled backward node under the stage's outputs")


def accumulate(node: torch.autograd.graph.Node, grads: Sequence[torch.Tensor | None]) -> None:
    """Deliver W's gradients (in the order of the compiled function's inputs) along the
    node's edges, in one engine call: AccumulateGrad and parameter hooks fire as in B."""
    edges = node.next_functions
    assert len(grads) <= len(edges), (len(grads), len(edges))
    roots = [(GradientEdge(c, i), g) for (c, i), g in zip(edges, grads) if c is not None and g is not None]
    if roots:
        torch.autograd.backward([e for e, _ in roots], [g for _, g in roots])
