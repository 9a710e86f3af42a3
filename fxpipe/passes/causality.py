"""Whether a captured model's attention is causal: a check on the graph, before training.

``fxpipe run`` trains next-token prediction: position i's target is token i + 1. A
model whose attention lets position i see later positions — an encoder such as BERT
loaded through ``AutoModelForCausalLM`` without ``is_decoder`` — reads its targets in its
inputs and trains to a loss near zero that means nothing. Nothing fails; so it is
checked here, from the graph alone.

Every ``scaled_dot_product_attention`` of the graph is read: ``is_causal=True`` is
causal; a mask built from the batch's shape (position indices compared, as transformers'
mask functions build it) is evaluated on the CPU with zero inputs — only the mask's own
ancestors run — and causal means no position is allowed to see a later one; no mask
and ``is_causal=False`` is bidirectional. A graph without SDPA (hand-written softmax
attention) or a mask that needs more than ``MAX_EVAL_BYTES`` of inputs is not judged
(``None``).
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx

from fxpipe.ir.program import Program
from fxpipe.passes.device import retarget_device

MAX_EVAL_BYTES = 64 << 20
"""Inputs a mask may need to be evaluated (an embedding read for its dtype costs its table)."""


def _sdpa_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


def _mask(node: fx.Node) -> tuple[object, bool]:
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return mask, bool(causal)


def mask_value(program: Program, mask: fx.Node) -> torch.Tensor | None:
    """``mask``'s value with every input zero, on the CPU (None: too costly to build); exact
    when the mask reads no input (``causal_mask``'s rewrite)."""
    gm = copy.deepcopy(program.graph_module)
    graph = gm.graph
    target = next(n for n in graph.nodes if n.name == mask.name)
    keep, stack = set(), [target]
    while stack:
        n = stack.pop()
        if n not in keep:
            keep.add(n)
            stack.extend(n.all_input_nodes)
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((target,),)
    for n in reversed(list(graph.nodes)):
        if n.op not in ("placeholder", "output") and n not in keep:
            graph.erase_node(n)
    args, total = [], 0
    for p in (n for n in graph.nodes if n.op == "placeholder"):
        val = p.meta.get("val")
        if not p.users or not isinstance(val, torch.Tensor):
            args.append(None)
            continue
        total += val.numel() * val.element_size()
        if total > MAX_EVAL_BYTES:
            return None
        args.append(torch.zeros(val.shape, dtype=val.dtype))
    gm.recompile()
    gm = retarget_device(program.replace(graph_module=gm), torch.device("cpu")).graph_module
    with torch.no_grad():
        return gm(*args)[0]


def attention_is_causal(program: Program) -> bool | None:
    """True if every attention is causal, False if one lets a position see a later one,
    None if the graph does not say (module docstring)."""
    nodes = _sdpa_nodes(program.graph)
    if not nodes:
        return None
    verdicts = []
    for node in nodes[:1] if len(nodes) == 1 else (nodes[0], nodes[-1]):
        mask, causal = _mask(node)
        if causal:
            verdicts.append(True)
            continue
        if not isinstance(mask, fx.Node):
            verdicts.append(False)
            continue
        try:
            value = mask_value(program, mask)
        except Exception:  # noqa: BLE001 - a mask that cannot run alone is not judged
            value = None
        if value is None:
            verdicts.append(None)
            continue
        allowed = value if value.dtype == torch.bool else value > torch.finfo(value.dtype).min / 2
        later = torch.ones(allowed.shape[-2:], dtype=torch.bool).triu(1)
        verdicts.append(not bool((allowed & later).any()))
    if False in verdicts:
        return False
    return True if all(v is True for v in verdicts) else None
