"""Functionalize: no in-place op survives capture, so no pass can lose one.

torch.export's training IR keeps the model's in-place ops: ``mask[..., :n].fill_(v)``,
``x.masked_fill_(m, v)``, ``x[idx] = v`` (``index_put_``), ``out.index_add_(...)``.
Such a node writes into its argument and is usually read by nobody, so every pass
that follows data edges (stage construction, recomputation, probe groups) can drop
it without a trace, and a stage that receives a tensor and writes into it fails in
autograd ("a leaf Variable that requires grad is being used in an in-place
operation"). This pass rewrites each mutation as the out-of-place op whose result
is used from then on — the same rewrite torch's functionalization makes
(``torch.func.functionalize``), done on the captured graph itself because torch's
re-tracing routes (``ExportedProgram.run_decompositions``) inline ``no_grad``
regions without a trace of the grad mode and decompose the composite ops
(``linear``, ``scaled_dot_product_attention``) the tensor-parallel pass reads.

How. A tensor and the views taken of it (ops whose schema says they return an alias
of their input) form one alias group with a *root*, the node that made the tensor. A write
``op_(view, *args)`` becomes ``new = op(view, *args)`` and is carried up the view
chain to the root with the scatter op that inverts each view (``slice`` ->
``slice_scatter``, ``select`` -> ``select_scatter``, ``view``/``unsqueeze``/... ->
``reshape_as``, ``transpose``/``permute`` -> themselves inverted). The group's
version then changes, and every later read of any member is regenerated from the new
root by replaying its views. A write to a buffer placeholder becomes a graph output
(the runtime writes it back); a write to a parameter or a batch input, or through a
view this pass cannot invert, is refused naming the node. What the schemas say about
writes and views, and each view's inverse, is ``aliasing.py``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxpipe.passes.aliasing import (IDENTITIES, FunctionalizeError, functional_op, inverse_view, is_view,
                                    mutated_args, same_storage, view_parent, where)

aten = torch.ops.aten


@dataclass(frozen=True)
class Functionalized:
    graph_module: fx.GraphModule
    mutations: int
    """In-place nodes rewritten (0: the graph was already functional and is returned as is)."""
    buffer_updates: tuple[tuple[str, str], ...]
    """(placeholder name, output node name) for every buffer the forward writes."""


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, writable: Callable[[fx.Node], bool],
                 names: Mapping[str, str], region_writes: Mapping[str, tuple[int, ...]]) -> None:
        self.names = names
        self.region_writes = region_writes
        self.src = gm.graph
        self.gm = gm
        self.writable = writable
        vals = [n.meta.get("val") for n in self.src.nodes]
        self.fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        self.g = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.key: dict[fx.Node, Any] = {}      # node -> its alias group
        self.root: dict[Any, fx.Node] = {}     # group -> the node that made the tensor
        self.current: dict[Any, fx.Node] = {}  # group -> new-graph node of the root's value now
        self.version: dict[Any, int] = {}
        self.seen: dict[fx.Node, tuple[int, fx.Node]] = {}  # alias -> (version, its value then)
        self.alias_of: dict[fx.Node, fx.Node] = {}  # in-place node -> the tensor it wrote
        self.mutations = 0
        for n in self.src.nodes:  # alias groups, from the graph's structure
            if not isinstance(n.meta.get("val"), torch.Tensor):
                continue
            k: Any = n  # a node that makes a new tensor starts a group of its own
            if mutated_args(n):
                k = self.key.get(n.args[0], n)  # x.add_(y) returns x
            elif is_view(n):
                parent = view_parent(n)
                if parent in self.key and (n.target not in IDENTITIES or same_storage(n, parent)):
                    k = self.key[parent]
            self.key[n] = k
            self.root.setdefault(k, n)

    # ---- new nodes ---------------------------------------------------------------
    def _emit(self, target, args: tuple, kwargs: dict, like: fx.Node) -> fx.Node:
        new = self.g.call_function(target, args, kwargs)
        for field in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node",
                      "torch_fn", "custom"):
            if field in like.meta:
                new.meta[field] = like.meta[field]
        fake = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
        fargs = fx.node.map_aggregate(args, fake)
        fkwargs = fx.node.map_aggregate(kwargs, fake)
        if self.fake_mode is not None:
            with self.fake_mode:
                new.meta["val"] = target(*fargs, **fkwargs)
        else:
            new.meta["val"] = target(*fargs, **fkwargs)
        return new

    # ---- reading a value -----------------------------------------------------------
    def value(self, n: fx.Node) -> fx.Node:
        n = self._resolve(n)
        k = self.key.get(n)
        if k is None or k not in self.version:
            return self.env[n]
        ver = self.version[k]
        got = self.seen.get(n)
        if got is not None and got[0] == ver:
            return got[1]
        # Group members are the root and views of it (in-place results were resolved).
        out = self.current[k] if n is self.root[k] else self._replay(n)
        self.seen[n] = (ver, out)
        return out

    def _replay(self, n: fx.Node) -> fx.Node:
        """The view ``n`` taken again from its parent's current value."""
        if n.target is operator.getitem:
            multi = n.args[0]
            margs = (self.value(multi.args[0]), *self._map(multi.args[1:]))
            again = self._emit(multi.target, margs, self._map(multi.kwargs), multi)
            return self._emit(operator.getitem, (again, n.args[1]), {}, n)
        args = (self.value(n.args[0]), *self._map(n.args[1:]))
        return self._emit(n.target, args, self._map(n.kwargs), n)

    def _map(self, a: Any) -> Any:
        return fx.node.map_arg(a, self.value)

    # ---- a write -------------------------------------------------------------------
    def _resolve(self, n: fx.Node) -> fx.Node:
        """The tensor an in-place result stands for (``x.mul_(a).add_(b)`` writes x twice)."""
        while n in self.alias_of:
            n = self.alias_of[n]
        return n

    def write(self, m: fx.Node) -> None:
        target = self._resolve(m.args[0])
        if m.target == aten.detach_.default:
            # Only autograd metadata changes: from here on the tensor reads detached.
            self._commit(target, self._emit(aten.detach.default, (self.value(target),), {}, m), m)
            self.alias_of[m] = target
            return
        k = self.key.get(target)
        if k is None:
            raise FunctionalizeError(f"cannot make {where(m)} functional: its target has no "
                                     f"tensor metadata")
        root = self.root[k]
        if root.op == "placeholder" and not self.writable(root):
            raise FunctionalizeError(
                f"the forward writes in place into {self.names.get(root.name, root.name)}, a "
                f"parameter or batch input, at {where(m)}; use an out-of-place op (e.g. x = x.add(y), not x.add_(y))")
        if m.target == aten.copy_.default:
            new = self._copied(target, m)
        else:
            op = functional_op(m)
            new = self._emit(op, (self.value(target), *self._map(m.args[1:])), self._map(m.kwargs), m)
        self._commit(target, new, m)
        self.alias_of[m] = target

    def _copied(self, target: fx.Node, m: fx.Node) -> fx.Node:
        """``target.copy_(src)`` as a value: src in target's dtype, device and shape.
        (aten.copy, torch's functional form, has no derivative: the gradient would stop.)"""
        src = self.value(m.args[1])
        want, got = target.meta["val"], m.args[1].meta["val"]
        if (got.dtype, got.device) != (want.dtype, want.device):
            src = self._emit(aten._to_copy.default, (src,), {"dtype": want.dtype, "device": want.device}, m)
        if tuple(got.shape) != tuple(want.shape):
            src = self._emit(aten.expand_as.default, (src, self.value(target)), {}, m)
        return src

    def _commit(self, target: fx.Node, new: fx.Node, m: fx.Node) -> None:
        """From ``m`` on, ``target`` holds ``new``: carry it up to the alias group's root."""
        k = self.key[target]
        root = self.root[k]
        want = target.meta["val"]
        if new.meta["val"].dtype != want.dtype:  # in place keeps the target's dtype
            new = self._emit(aten._to_copy.default, (new,), {"dtype": want.dtype}, m)
        value, child = new, target
        while child is not root:
            if not is_view(child):
                raise FunctionalizeError(f"cannot make {where(m)} functional: {child.name} shares "
                                         f"storage with {root.name} but is not a view of it")
            parent = self._resolve(view_parent(child))
            value = inverse_view(child, self.value(parent), value,
                                 lambda target, args: self._emit(target, args, {}, m), m)
            child = parent
        self.version[k] = self.version.get(k, 0) + 1
        self.current[k] = value
        self.seen[root] = (self.version[k], value)
        self.seen[target] = (self.version[k], new)
        self.mutations += 1

    def region(self, n: fx.Node, attr: fx.Node) -> None:
        """A call of a control-flow region (no_grad, autocast) whose body writes into some
        of its inputs: the functional body returns their new values after its own results,
        and each becomes a write into the caller's tensor."""
        new = self.g.node_copy(n, self.value)
        old = n.meta["val"]
        body = getattr(self.gm, attr.target)
        phs = [p for p in body.graph.nodes if p.op == "placeholder"]
        writes = self.region_writes[attr.target]
        new.meta["val"] = tuple(old) + tuple(phs[i].meta["val"] for i in writes)
        self.env[n] = new
        first = n.args.index(attr) + 1
        for j, i in enumerate(writes):
            target = self._resolve(n.args[first + i])
            k = self.key.get(target)
            root = self.root.get(k)
            if root is None or (root.op == "placeholder" and not self.writable(root)):
                name = self.names.get(getattr(root, "name", ""), getattr(root, "name", "?"))
                raise FunctionalizeError(
                    f"the forward writes in place into {name}, a parameter or batch input, inside "
                    f"the region {where(n)}; use an out-of-place op")
            got = self._emit(operator.getitem, (new, len(old) + j), {}, n)
            self._commit(target, got, n)

    # ---- the whole graph -----------------------------------------------------------
    def _region_attr(self, n: fx.Node) -> fx.Node | None:
        if n.op != "call_function":
            return None
        return next((a for a in n.args if isinstance(a, fx.Node) and a.op == "get_attr"
                     and a.target in self.region_writes), None)

    def run(self) -> tuple[fx.Graph, list[tuple[str, fx.Node]]]:
        for n in self.src.nodes:
            if n.op == "placeholder":
                self.env[n] = self.g.placeholder(n.name)
                self.env[n].meta = dict(n.meta)
            elif n.op == "output":
                updates = [(self.root[k].name, self.current[k]) for k in self.current
                           if self.root[k].op == "placeholder"]
                self.g.output(self._map(n.args[0]))
                return self.g, updates
            elif mutated_args(n):
                self.write(n)
            elif (attr := self._region_attr(n)) is not None:
                self.region(n, attr)
            elif n.op == "get_attr":
                self.env[n] = self.g.get_attr(n.target)
                self.env[n].meta = dict(n.meta)
            else:
                self.env[n] = self.g.node_copy(n, self.value)
        raise AssertionError("graph without output")


def functionalize(gm: fx.GraphModule, writable: Callable[[fx.Node], bool] = lambda n: False,
                  names: Mapping[str, str] | None = None) -> Functionalized:
    """Rewrite every in-place op of ``gm`` (and of its control-flow submodules) out of
    place. ``writable(placeholder)`` says which graph inputs may be written (buffers):
    their final values are put in front of the graph's outputs, in ``buffer_updates``.
    ``names`` maps placeholder names to what messages call them (the user's names)."""
    return _functionalize(gm, writable, names or {}, updates_last=False)


def _functionalize(gm: fx.GraphModule, writable: Callable[[fx.Node], bool],
                   names: Mapping[str, str], updates_last: bool) -> Functionalized:
    inner = 0
    region_writes: dict[str, tuple[int, ...]] = {}
    for name, sub in list(gm.named_children()):
        if isinstance(sub, fx.GraphModule):  # no_grad / autocast regions and the like
            # A region may write into its inputs; the caller decides whether it may.
            done = _functionalize(sub, lambda n: True, {}, updates_last=True)
            if done.mutations:
                setattr(gm, name, done.graph_module)
                inner += done.mutations
                phs = [p.name for p in sub.graph.nodes if p.op == "placeholder"]
                region_writes[name] = tuple(phs.index(p) for p, _ in done.buffer_updates)
    if not any(mutated_args(n) for n in gm.graph.nodes) and not any(region_writes.values()):
        return Functionalized(gm, inner, ())
    rw = _Rewriter(gm, writable, names, {k: v for k, v in region_writes.items() if v})
    graph, updates = rw.run()
    buffer_updates = ()
    if updates:
        out = next(n for n in graph.nodes if n.op == "output")
        results = out.args[0]
        results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
        written = tuple(v for _, v in updates)
        out.args = ((results + written) if updates_last else (written + results),)
        buffer_updates = tuple((name, v.name) for name, v in updates)
    graph.eliminate_dead_code()
    new = fx.GraphModule(gm, graph)
    return Functionalized(new, rw.mutations + inner, buffer_updates)
