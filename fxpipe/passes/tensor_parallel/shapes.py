"""The rewritten graph's shapes (``meta["val"]``), propagated again with FakeTensors.

A rank's graph differs from the capture inside the tensor-parallel blocks (sharded
weights, head counts, the collectives added) and nowhere else: the residual stream,
its norms and everything the blocks' reductions hand back keep the capture's shapes.
Propagating all of it costs ~1 ms of FakeTensor dispatch per node (a quarter of the
layout search's compile time, ``benchmarks/bench_search_time.py``), so a node copied
unchanged from the capture whose inputs come back with their captured metadata keeps
its captured value instead of being run again. That value is what the propagation
would give: the op, its constants and its inputs' shapes, strides and dtypes are the
capture's (an input may come from an added collective: the reduction after a
row-parallel projection gives back the projection's captured shape). Where the captured output aliases an input (a view), the inputs must be the
captured values themselves, not equal ones, so that aliasing stays true between the
values kept and the values recomputed.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree


def refresh_shapes(gm: fx.GraphModule, local_params: dict[str, tuple[int, ...]],
                   captured: fx.Graph | None = None) -> None:
    """Every node's ``meta["val"]`` for this rank's graph ``gm``; placeholders take their
    ``local_params`` shape. ``captured``: the graph ``gm`` was copied from (nodes under
    their own names), whose unchanged nodes keep their values (module docstring)."""
    # Ops whose output size the data decides (nonzero, where) need the capture's shape
    # environment: their symbols are bound again to the capture's (fxpipe/ir/sizes.py).
    mode = detect_fake_mode([v for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)])
    if mode is None or mode.shape_env is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        captured = None  # values of another mode cannot be mixed with this one's
    args = []
    with mode:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                val = node.meta["val"]
                shape = local_params.get(node.name, tuple(val.shape))
                args.append(torch.empty(shape, dtype=val.dtype, device=val.device))
    originals = {n.name: n for n in captured.nodes} if captured is not None else {}
    _Propagation(gm, mode, originals).propagate_dont_convert_inputs(*args)


class _Propagation(FakeTensorProp):
    """A node's ``meta["val"]`` is still the captured one (copied with the node) until
    the propagation reaches it: kept where ``_unchanged``, replaced otherwise."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, originals: dict[str, fx.Node]) -> None:
        super().__init__(gm, mode)
        self.originals = originals

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function" and self._unchanged(n):
            return n.meta["val"]
        return super().run_node(n)

    def _unchanged(self, n: fx.Node) -> bool:
        source = self.originals.get(n.name)
        if source is None or source.target is not n.target or n.meta.get("val") is None:
            return False
        pairs: list[tuple[fx.Node, fx.Node]] = []  # (captured input, this graph's input)
        if not (_same_call(source.args, n.args, pairs) and _same_call(source.kwargs, n.kwargs, pairs)):
            return False
        # The captured inputs' values (an input may sit inside a closed autocast region here).
        before = [a.meta.get("val") for a, _ in pairs]
        if any(v is None for v in before):
            return False
        if _aliases_an_input(n.meta["val"], before):
            return all(self.env[b] is v for (_, b), v in zip(pairs, before))
        return all(_same_metadata(self.env[b], v) for (_, b), v in zip(pairs, before))


def _same_call(before: Any, after: Any, pairs: list[tuple[fx.Node, fx.Node]]) -> bool:
    """The same arguments but for the nodes, which are paired up in ``pairs`` (a value
    routed through an added collective arrives from the collective)."""
    if isinstance(before, fx.Node) or isinstance(after, fx.Node):
        pairs.append((before, after))
        return isinstance(before, fx.Node) and isinstance(after, fx.Node)
    if isinstance(before, (list, tuple)) and isinstance(after, (list, tuple)):
        return type(before) is type(after) and len(before) == len(after) and \
            all(_same_call(b, a, pairs) for b, a in zip(before, after))
    if isinstance(before, dict) and isinstance(after, dict):
        return before.keys() == after.keys() and all(_same_call(before[k], after[k], pairs) for k in before)
    if isinstance(before, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)) or \
            isinstance(after, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return before is after
    return type(before) is type(after) and before == after


def _static(sizes: Any) -> bool:
    return all(type(s) is int for s in sizes)


def _same_metadata(a: Any, b: Any) -> bool:
    """Equal shapes, strides, offsets, dtypes and devices, all static (a symbolic size is
    never compared: that would add a guard to the capture's shape environment)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if not (_static(a.shape) and _static(b.shape) and _static(a.stride()) and _static(b.stride())):
            return False
        return (tuple(a.shape), a.stride(), a.dtype, a.device) == (tuple(b.shape), b.stride(), b.dtype, b.device) \
            and type(a.storage_offset()) is int and a.storage_offset() == b.storage_offset()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_metadata(x, y) for x, y in zip(a, b))
    return type(a) in (int, float, bool) and type(a) is type(b) and a == b


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _aliases_an_input(output: Any, inputs: list[Any]) -> bool:
    storages = {StorageWeakRef(t.untyped_storage()) for v in inputs for t in _tensors(v)}
    return any(StorageWeakRef(t.untyped_storage()) in storages for t in _tensors(output))
