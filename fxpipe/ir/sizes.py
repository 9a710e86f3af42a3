"""Sizes that only the data decides (unbacked symbols), priced without guarding on them.

``torch.nonzero``, ``torch.where(mask)`` and boolean indexing give tensors whose length
depends on values: torch.export records it as an unbacked symbol (``u0``) in the
FakeTensor shapes, and ``int()`` of it raises ``GuardOnDataDependentSymNode``. A
dropless mixture-of-experts routes tokens this way. Passes that need a number (FLOPs,
bytes, activation memory) ask :func:`concrete` with the Program's ``size_hints``:

- the size seen when the captured graph ran on the example batch (real tensors:
  :func:`observe_sizes`), or
- without real tensors (a meta capture), the largest value the symbol can take
  (torch's value range for it, e.g. every token for ``nonzero`` of a token mask):
  an upper bound, so memory estimates stay safe.

A tensor whose shape holds such a symbol never crosses a pipeline stage (the partition
keeps producer and consumers together; ``split_pass`` refuses otherwise): transfers are
posted with the plan's static shapes. Inside a stage it runs as it is.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

UNBOUNDED = 1 << 31
"""Stand-in for a symbol with no finite bound (never seen in practice: nonzero and
boolean masks are bounded by their input's size)."""


def is_dynamic(val: Any) -> bool:
    """Does ``val`` (a node's FakeTensor or a tuple of them) have a data-dependent size?"""
    if isinstance(val, (tuple, list)):
        return any(is_dynamic(v) for v in val)
    return isinstance(val, (torch.Tensor, torch.SymInt)) and bool(free_unbacked_symbols(val))


def concrete(x: Any, hints: Mapping[str, int]) -> int:
    """An int for ``x`` (an int or SymInt) without adding a guard."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    node = x.node
    if node.hint is not None:
        return int(node.hint)
    env = node.shape_env
    expr = node.expr
    sub = {s: sympy.Integer(hints[str(s)]) for s in expr.free_symbols if str(s) in hints}
    expr = expr.xreplace(sub).xreplace(getattr(env, "backed_var_to_val", {}))
    if expr.is_number:
        return int(expr)
    upper = env.bound_sympy(expr).upper
    return int(upper) if upper.is_finite else UNBOUNDED


def numel(t: torch.Tensor, hints: Mapping[str, int]) -> int:
    n = 1
    for d in t.shape:
        n *= concrete(d, hints)
    return n


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.seen: dict[str, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        val = n.meta.get("val")
        pairs = [(val, out)] if isinstance(val, torch.Tensor) else \
            list(zip(val, out)) if isinstance(val, (tuple, list)) and isinstance(out, (tuple, list)) else []
        for fake, real in pairs:
            if not isinstance(fake, torch.Tensor) or not isinstance(real, torch.Tensor):
                continue
            for d, r in zip(fake.shape, real.shape):
                if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                    self.seen.setdefault(str(d.node.expr), int(r))
        return out


def observe_sizes(gm: fx.GraphModule, args: Sequence[torch.Tensor]) -> dict[str, int]:
    """Run ``gm`` once on real ``args`` (no autograd) and return the value each unbacked
    symbol took: the size-hint source for a capture on real tensors."""
    with torch.no_grad():
        rec = _Recorder(gm)
        rec.run(*args)
    return rec.seen


def unbacked_symbols(gm: fx.GraphModule) -> list[str]:
    """Names of the data-dependent size symbols in the graph, in first-seen order."""
    names: dict[str, None] = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else (val,)):
            if isinstance(v, torch.Tensor):
                for s in sorted(free_unbacked_symbols(v), key=str):
                    names[str(s)] = None
    return list(names)


def carry_hints(old: fx.Graph, new: fx.Graph, hints: Mapping[str, int]) -> dict[str, int]:
    """``hints`` for a graph whose shapes were propagated again (fresh symbols): a symbol
    of ``new`` gets the value of the symbol at the same place (node name, dimension) of
    ``old``."""
    if not hints:
        return {}
    before = {n.name: n.meta.get("val") for n in old.nodes}
    out: dict[str, int] = {}
    for n in new.nodes:
        a, b = before.get(n.name), n.meta.get("val")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != b.dim():
            continue
        for x, y in zip(a.shape, b.shape):
            if isinstance(x, torch.SymInt) and isinstance(y, torch.SymInt) and \
                    str(x.node.expr) in hints and isinstance(y.node.expr, sympy.Symbol):
                out.setdefault(str(y.node.expr), hints[str(x.node.expr)])
    return out


def describe_hints(symbols: Sequence[str], hints: Mapping[str, int]) -> str:
    """One line on how data-dependent sizes are priced (``fxpipe compile``'s summary)."""
    seen = [hints[s] for s in symbols if s in hints]
    head = f"{len(symbols)} size(s) decided by the data ({', '.join(symbols[:4])}" \
           f"{', ...' if len(symbols) > 4 else ''}); "
    if len(seen) == len(symbols):
        return head + (f"priced at the example batch's sizes ({min(seen)}-{max(seen)}, "
                       f"mean {sum(seen) / len(seen):.1f}); inside one stage each")
    return head + ("priced at their upper bounds (no real tensors to run the example batch "
                   "on); inside one stage each")
