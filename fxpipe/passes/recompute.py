"""Activation recomputation: rewrite layers (or their attention cores) into checkpointed regions.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models": per layer a transformer saves sbh(34 + 5as/h) bytes for backward (fp16).

- FULL (Megatron's ``--recompute-granularity full``, Chen et al. 2016): every
  contiguous run of one layer's nodes becomes one region; the forward keeps only
  the region's inputs (the layer input, 2sbh) and backward reruns the region.
- SELECTIVE (§4.1): only the attention core — the ops between the Q/K/V
  projections' outputs and the output projection's input (QKᵀ, softmax, dropout,
  ·V, or one fused SDPA kernel) — is recomputed: the 5as/h term, large in memory
  and cheap in FLOPs, is never stored; the 34 stays.

A region is outlined into a submodule ``CheckpointedRegion`` (``ir/recompute_region.py``),
one autograd node that keeps the region's inputs and reruns its body in backward from
the random state of the first run, so dropout masks replay exactly. Regions are found from
structure alone (layer indices from capture, op kinds, parameter inputs), never
from module names. The graph's placeholders and outputs are unchanged, so
``Stage.call`` and ``Program.run`` work as before. Works on a whole Program's
graph or on one pipeline stage's graph (a layer cut across two stages gives one
region per piece).
"""
from __future__ import annotations

import copy
import dataclasses
import operator
import warnings
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.fx as fx

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.pass_results import RecomputeRegion
from fxpipe.ir.recompute_region import CheckpointedRegion
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.ir.subgraph import boundary, copy_subgraph

aten = torch.ops.aten

LAYER_KEY = "fxpipe_layer"
"""``node.meta`` key holding the layer index of a region's call and getitem nodes
(they are not in the capture's ``layers`` map; ``fxpipe.costs.saved_activations`` reads it)."""
REGION_KEY = "fxpipe_recompute"
"""``node.meta`` key holding the :class:`RecomputeRegion` of a region's call node."""


class RecomputeWarning(UserWarning):
    """Recomputation was asked for but there is nothing to recompute."""


# Matrix multiplies. One with a parameter operand is a projection (a region boundary);
# one between two activations (QKᵀ, ·V) belongs to the attention core.
_MATMULS = frozenset({aten.linear.default, aten.matmul.default, aten.mm.default, aten.bmm.default,
                      aten.addmm.default, aten.baddbmm.default, aten.einsum.default})
# Ops that carry a parameter to a matmul unchanged in value (t(W), W.to(bf16), ...).
_PASS_THROUGH = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
                           aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                           aten.alias.default, aten.detach.default, aten.to.dtype,
                           aten._to_copy.default, aten.contiguous.default, aten.clone.default})
_SOFTMAX = frozenset({aten._softmax.default, aten.softmax.int, aten._safe_softmax.default})


def _sdpa_ops() -> frozenset:
    names = ["scaled_dot_product_attention", "_scaled_dot_product_attention_math",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_fused_attention_overrideable"]
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


_SDPA = _sdpa_ops()


def _weights(graph: fx.Graph) -> set[fx.Node]:
    """Graph inputs that are parameters: capture tags them with ``fxpipe_fqn`` (split
    keeps the tag); an untagged graph treats every placeholder as a possible weight."""
    inputs = [n for n in graph.nodes if n.op in ("placeholder", "get_attr")]
    tagged = {n for n in inputs if "fxpipe_fqn" in n.meta or n.op == "get_attr"}
    return tagged if any("fxpipe_fqn" in n.meta for n in inputs) else set(inputs)


def _from_weight(node: fx.Node, weights: set[fx.Node]) -> bool:
    while node not in weights:
        if node.op != "call_function" or node.target not in _PASS_THROUGH or not node.all_input_nodes:
            return False
        node = node.all_input_nodes[0]
    return True


def _is_projection(node: fx.Node, weights: set[fx.Node]) -> bool:
    return node.op == "call_function" and node.target in _MATMULS and \
        any(_from_weight(a, weights) for a in node.all_input_nodes)


def layer_runs(gm: fx.GraphModule, layers: Mapping[str, int]) -> list[tuple[int, list[fx.Node]]]:
    """Maximal runs of consecutive compute nodes (graph order) that share a layer index."""
    runs: list[tuple[int, list[fx.Node]]] = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        k = layers.get(node.name)
        if k is None:
            runs.append((-1, []))  # a non-layer node ends the current run
        elif runs and runs[-1][0] == k and runs[-1][1]:
            runs[-1][1].append(node)
        else:
            runs.append((k, [node]))
    return [(k, nodes) for k, nodes in runs if nodes]


def _attention_cores(run: list[fx.Node], weights: set[fx.Node]) -> list[list[fx.Node]]:
    """The attention cores of one layer run: the connected pieces of the run, with
    its projections removed, that hold an SDPA kernel or a softmax between two
    activation-activation matmuls (unfused QKᵀ -> softmax -> dropout -> ·V)."""
    free = [n for n in run if not _is_projection(n, weights)]
    free_set = set(free)
    parent = {n: n for n in free}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in free:
        for u in n.users:
            if u in free_set:
                parent[find(u)] = find(n)
    pieces: dict[fx.Node, list[fx.Node]] = {}
    for n in free:
        pieces.setdefault(find(n), []).append(n)
    cores = []
    for piece in pieces.values():
        has_sdpa = any(n.op == "call_function" and n.target in _SDPA for n in piece)
        has_softmax = any(n.op == "call_function" and n.target in _SOFTMAX for n in piece)
        act_matmuls = sum(n.op == "call_function" and n.target in _MATMULS for n in piece)
        if has_sdpa or (has_softmax and act_matmuls >= 2):
            core = _convex(piece)
            if core:
                cores.append(core)
    return cores


def _convex(region_nodes: list[fx.Node]) -> list[fx.Node]:
    """Drop nodes until no path leaves the region and re-enters it (a region is called
    once, so such a path would be a cycle). Drops the upstream end of such paths,
    keeping the attention kernel; returns [] if the kernel itself would go."""
    region = set(region_nodes)
    order = {n: i for i, n in enumerate(region_nodes[0].graph.nodes)}
    while region:
        lo, hi = min(order[n] for n in region), max(order[n] for n in region)
        span = [n for n in region_nodes[0].graph.nodes if lo <= order[n] <= hi]
        feeds_back: set[fx.Node] = set()  # outside nodes with a path into the region
        for n in reversed(span):
            if n not in region and any(u in region or u in feeds_back for u in n.users):
                feeds_back.add(n)
        bad = {n for n in region if any(u in feeds_back for u in n.users)}
        if not bad:
            break
        region -= bad
    kept = [n for n in region_nodes if n in region]
    has_kernel = any(n.target in _SDPA or n.target in _SOFTMAX for n in kept if n.op == "call_function")
    return kept if has_kernel else []


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str, layer: int,
             mode: RecomputeMode) -> RecomputeRegion | None:
    """Move ``nodes`` (graph order, convex) into a ``CheckpointedRegion`` submodule."""
    graph = gm.graph
    region = set(nodes)
    inputs, outputs = boundary(nodes)
    if not outputs:
        return None  # nothing reads it: dead code, left for the caller's DCE

    body, _ = copy_subgraph(inputs, nodes, outputs)
    gm.add_submodule(name, CheckpointedRegion(fx.GraphModule(gm, body, class_name=name)))

    info = RecomputeRegion(name=name, layer=layer, mode=mode, nodes=tuple(n.name for n in nodes),
                           inputs=tuple(a.name for a in inputs), outputs=tuple(o.name for o in outputs))
    last = nodes[-1]
    with graph.inserting_after(last):
        call = graph.call_module(name, tuple(inputs))
    call.meta.update({LAYER_KEY: layer, REGION_KEY: info,
                      "val": tuple(o.meta.get("val") for o in outputs)})
    anchor, getters = call, []
    for i, o in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, i))
        anchor.meta.update({LAYER_KEY: layer, "val": o.meta.get("val")})
        getters.append(anchor)
    # Outside nodes placed between the region's nodes that read its outputs must now
    # come after the call (only for non-contiguous regions; convexity makes it legal).
    moved: set[fx.Node] = set()
    n = nodes[0]
    while n is not last:
        nxt = n.next
        if n not in region and any(a in region or a in moved for a in n.all_input_nodes):
            moved.add(n)
            anchor.append(n)
            anchor = n
        n = nxt
    for o, g in zip(outputs, getters):
        o.replace_all_uses_with(g, delete_user_cb=lambda user: user not in region)
    for n in reversed(nodes):
        graph.erase_node(n)
    return info


def find_regions(gm: fx.GraphModule, layers: Mapping[str, int],
                 mode: RecomputeMode) -> list[tuple[int, list[fx.Node]]]:
    """(layer, nodes) of every region ``mode`` would outline, in graph order."""
    if mode is RecomputeMode.NONE:
        return []
    runs = layer_runs(gm, layers)
    if mode is RecomputeMode.FULL:
        return runs
    weights = _weights(gm.graph)
    return [(k, core) for k, run in runs for core in _attention_cores(run, weights)]


@dataclass(frozen=True)
class RecomputePricing:
    """What ``mode`` changes in the partition's per-node costs (``passes/assign_stages.py``)."""
    recomputed: frozenset[str]
    """Nodes inside a region: nothing kept for backward, their forward run again in backward."""
    kept_inputs: Mapping[str, int]
    """Per region's first node: bytes of the region's inputs that are themselves recomputed
    elsewhere (the checkpoint keeps them; an input outside every region is counted where
    it is made)."""


def recompute_pricing(gm: fx.GraphModule, layers: Mapping[str, int], mode: RecomputeMode,
                      out_bytes: Mapping[str, int]) -> RecomputePricing:
    """Price ``mode`` on a whole graph before the split: the regions ``apply_recompute``
    would outline there (a layer the split cuts is recomputed piecewise, which keeps one
    more boundary tensor; not counted)."""
    regions = find_regions(gm, layers, mode)
    recomputed = frozenset(n.name for _, nodes in regions for n in nodes)
    kept: dict[str, int] = {}
    for _, nodes in regions:
        inputs, _ = boundary(nodes)
        kept[nodes[0].name] = sum(out_bytes.get(a.name, 0) for a in inputs if a.name in recomputed)
    return RecomputePricing(recomputed=recomputed, kept_inputs=kept)


def apply_recompute(gm: fx.GraphModule, layers: Mapping[str, int],
                    mode: RecomputeMode) -> fx.GraphModule:
    """A copy of ``gm`` whose layers (FULL) or attention cores (SELECTIVE) are
    recomputed in backward; same placeholders, same outputs, same values.

    ``layers`` maps node names to layer indices (``Program.layers``; stage graphs
    keep the original names). Example, per pipeline stage after ``split_pass``::

        gm = apply_recompute(stage.graph_module, plan.program.layers, RecomputeMode.SELECTIVE)
        stage = dataclasses.replace(stage, graph_module=gm)
    """
    if not isinstance(mode, RecomputeMode):
        raise TypeError(f"mode must be a RecomputeMode, got {mode!r}; "
                        f"use RecomputeMode.parse('none'|'selective'|'full')")
    if mode is RecomputeMode.NONE:
        return gm
    if not layers:
        warnings.warn(RecomputeWarning(
            f"recompute={mode.value} asked, but the model has no repeated layers (capture found no "
            f"ModuleList of blocks), so there is nothing to recompute: the graph is returned "
            f"unchanged and every activation is saved"), stacklevel=2)
        return gm
    out = copy.deepcopy(gm)
    regions = find_regions(out, layers, mode)
    if mode is RecomputeMode.SELECTIVE:
        # Only whole layers are expected to hold an attention core: a pipeline stage
        # may hold just the MLP half of a layer cut across two stages.
        present = {n.name for n in out.graph.nodes}
        whole = {k for k in set(layers.values())} - {k for n, k in layers.items() if n not in present}
        missing = sorted(whole - {k for k, _ in regions})
        if missing:
            warnings.warn(RecomputeWarning(
                f"recompute=selective: layer(s) {missing} have no attention core (no SDPA kernel "
                f"and no softmax between two activation matmuls); they are not recomputed — "
                f"use recompute=full to recompute whole layers"), stacklevel=2)
    taken: set[str] = set()
    for k, nodes in regions:
        base = f"layer{k}_{'attn' if mode is RecomputeMode.SELECTIVE else 'full'}_recompute"
        name, i = base, 1
        while name in taken or hasattr(out, name):
            name, i = f"{base}_{i}", i + 1
        if _outline(out, nodes, name, k, mode) is not None:
            taken.add(name)
    out.graph.lint()
    out.recompile()
    return out


def regions_of(gm: fx.GraphModule) -> list[RecomputeRegion]:
    """The regions ``apply_recompute`` outlined in ``gm``, in graph order."""
    return [n.meta[REGION_KEY] for n in gm.graph.nodes if REGION_KEY in n.meta]


def recompute_pass(plan: PipelinePlan, ctx: CompileContext) -> PipelinePlan:
    """``config.recompute``'s regions outlined in every stage graph (``apply_recompute``).
    Per stage, after the split: the partition and the cost model see the flat graph, and
    a layer cut across two stages is recomputed piecewise."""
    mode = ctx.config.recompute
    if mode is RecomputeMode.NONE:
        return plan
    stages = tuple(dataclasses.replace(s, graph_module=apply_recompute(s.graph_module, plan.program.layers, mode))
                   for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)
