"""A causal mask computed from constants becomes SDPA's own ``is_causal``.

A model calls ``scaled_dot_product_attention`` with ``is_causal=True`` in eager mode,
but transformers builds an explicit boolean mask whenever the model is traced: position
indices from ``arange`` compared (``kv_idx <= q_idx``), packed-sequence ids from their
differences, the results and-ed and expanded to [b, 1, s, s]. SDPA then takes the
masked kernel: on the CPU a slower path of the flash kernel plus a ``where`` per call,
on CUDA never FlashAttention (it takes no mask) but the memory-efficient kernel, and a
b·s² mask in memory. When the mask depends on no input of the graph (no batch input, no
parameter) its value is known at compile time: it is evaluated once on the CPU
(``causality.mask_value``) and, when it is exactly SDPA's causal pattern (position i
sees positions 0..i: a boolean True there and False after, or an additive 0 and -inf)
for every batch row and head, the call takes ``is_causal=True`` and no mask.

Anything else keeps its mask: one built from the batch (padding, document ids read off
the tokens), a sliding window, a prefix-LM mask, a mask larger than ``MAX_MASK_ELEMENTS``
to evaluate. Right after canonicalize, so every later pass (the tensor-parallel rules,
the cost, the timing) sees the call as it runs.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.program import Program
from fxpipe.passes.causality import mask_value
from fxpipe.passes.graph_edit import GraphEdit
from fxpipe.passes.tensor_parallel.graph_ops import SDPA

MAX_MASK_ELEMENTS = 1 << 26
"""A mask of more elements is not evaluated (64 MB as booleans)."""
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _arguments(node: fx.Node) -> dict[str, object]:
    """The call's arguments by name (positional or keyword)."""
    return {**dict(zip(_ARGS, node.args)), **node.kwargs}


def _constant(node: fx.Node) -> bool:
    """Whether ``node`` depends on no placeholder (batch input, parameter, buffer) and
    draws no random numbers: its value is the same on every call."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" or n.op == "get_attr":
            return False
        if n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return False
        stack.extend(n.all_input_nodes)
    return True


def _is_causal_pattern(value: torch.Tensor, lq: int, lk: int) -> bool:
    """Exactly SDPA's ``is_causal`` mask, ``tril(ones(lq, lk))``, in every broadcast slice."""
    if value.dim() < 2 or tuple(value.shape[-2:]) != (lq, lk):
        return False
    if value.dtype == torch.bool:
        allowed = value
    elif value.dtype.is_floating_point:
        blocked = value <= torch.finfo(value.dtype).min / 2  # -inf, or transformers' finfo.min
        allowed = value == 0
        if not bool((allowed | blocked).all()):
            return False  # a bias besides the pattern (ALiBi, relative positions)
    else:
        return False
    return bool((allowed == torch.ones(lq, lk, dtype=torch.bool).tril()).all())


def _causal(program: Program, node: fx.Node, cache: dict[str, bool]) -> bool:
    """Whether ``node``'s mask may be replaced by ``is_causal=True``."""
    args = _arguments(node)
    mask, q, k = args.get("attn_mask"), args["query"], args["key"]
    if not isinstance(mask, fx.Node) or args.get("is_causal"):
        return False
    if mask.name not in cache:
        val, qv, kv = mask.meta.get("val"), q.meta.get("val"), k.meta.get("val")
        ok = isinstance(val, torch.Tensor) and isinstance(qv, torch.Tensor) and isinstance(kv, torch.Tensor) \
            and val.numel() <= MAX_MASK_ELEMENTS and _constant(mask)
        if ok:
            try:
                value = mask_value(program, mask)
            except Exception:  # noqa: BLE001 - a mask that cannot run alone keeps its mask
                value = None
            ok = value is not None and _is_causal_pattern(value, int(qv.shape[-2]), int(kv.shape[-2]))
        cache[mask.name] = ok
    return cache[mask.name]


def causal_mask_pass(program: Program, ctx: CompileContext | None = None) -> Program:
    """Every SDPA call whose mask is a constant causal pattern takes ``is_causal=True``
    instead (module docstring)."""
    cache: dict[str, bool] = {}
    causal = [n.name for n in program.graph.nodes
              if n.op == "call_function" and n.target is SDPA and _causal(program, n, cache)]
    if not causal:
        return program
    edit = GraphEdit.of(program)
    for name in causal:
        node = edit.by_name[name]
        args = _arguments(node)
        node.args = (args["query"], args["key"], args["value"])
        node.kwargs = {**{k: v for k, v in args.items() if k not in ("query", "key", "value", "attn_mask")},
                       "is_causal": True}
    return edit.pruned(program)  # the mask's computation, unless something else reads it
