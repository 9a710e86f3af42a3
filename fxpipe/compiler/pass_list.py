"""The compile pipeline's one list of passes, in order, each with the reason it is where it
is (``PIPELINE``); the graph passes every layout needs are the ones named in
``GRAPH_PASSES`` (``DEFAULT_PASSES``, what ``run_passes`` runs by default).

Every pass is ``name_pass(ir, ctx) -> ir``: the IR it rewrites (a Program, or after
``split`` a PipelinePlan) and the one ``CompileContext`` (``ir/compile_context.py``), the
same kind of IR returned. Each decides for itself whether the layout asks for it (a pass
that does not apply returns its input) and lives in ``fxpipe/passes`` in the module of its
name (``tensor_parallel`` in its package); the list holds the passes themselves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.program import Program
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.passes.canonicalize import canonicalize_pass
from fxpipe.passes.causal_mask import causal_mask_pass
from fxpipe.passes.coalesce_blocks import coalesce_blocks_pass
from fxpipe.passes.cost import cost_pass
from fxpipe.passes.device import device_pass
from fxpipe.passes.expert_parallel import expert_parallel_pass
from fxpipe.passes.grouped_attention import grouped_attention_pass
from fxpipe.passes.measure_costs import measure_costs_pass
from fxpipe.passes.model_stats import model_stats_pass
from fxpipe.passes.partition import partition_pass
from fxpipe.passes.recompute import recompute_pass
from fxpipe.passes.split import split_pass
from fxpipe.passes.split_loss import split_loss_pass
from fxpipe.passes.split_matmul import split_matmul_pass
from fxpipe.passes.tensor_parallel import tensor_parallel_pass
from fxpipe.passes.vocab_head import vocab_head_pass
from fxpipe.passes.vocab_rows import vocab_rows_pass

IR = Union[Program, PipelinePlan]
PassFn = Callable[[IR, CompileContext], IR]
"""A pass: the IR it rewrites and the context -> the same kind of IR (``split``, where the
Program becomes a PipelinePlan, is the one step between the two)."""


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: PassFn
    why: str


PIPELINE: tuple[PassSpec, ...] = (
    PassSpec("canonicalize", canonicalize_pass,
             "drop export's runtime asserts and dead values so later passes see computation only"),
    PassSpec("causal_mask", causal_mask_pass,
             "an attention mask computed from constants that is exactly the causal pattern becomes "
             "SDPA's is_causal (the kernel's fast path, no mask in memory); before TP, whose rules then "
             "see no mask"),
    PassSpec("model_stats", model_stats_pass,
             "count the whole model's FLOPs and parameters and find token inputs before TP shards them"),
    PassSpec("tensor_parallel", tensor_parallel_pass,
             "find Megatron column/row blocks and shard them (config.tp > 1); before cost, so "
             "costs are per rank"),
    PassSpec("expert_parallel", expert_parallel_pass,
             "config.ep > 1: each grouped MoE's experts owned by ep data-parallel ranks, tokens dispatched "
             "and combined by all-to-all; before cost, so the experts are costed at their local count"),
    PassSpec("grouped_attention", grouped_attention_pass,
             "keys and values repeated for grouped-query attention read by SDPA itself (enable_gqa, "
             "where the device's kernels take it); after TP, on the heads each rank holds, before "
             "cost, so the price and the timing see the graph that runs"),
    PassSpec("cost", cost_pass,
             "FLOPs and bytes per node from shapes; after every rewrite of the whole graph, so it "
             "prices the graph as rewritten"),
    PassSpec("device", device_pass,
             "rewrite device constants captured on cpu/meta to the stages' device"),
    PassSpec("split_matmul", split_matmul_pass,
             "cut ops heavier than half a stage's share (an LM head) so the partition can balance; "
             "after cost, which decides what is heavy, and re-costs the blocks"),
    PassSpec("split_loss", split_loss_pass,
             "config.split_loss: the cross-entropy over split logits computed block by block (running "
             "logsumexp and target pick), so the loss spreads with its blocks and only [tokens] vectors "
             "cross stages"),
    PassSpec("measure_costs", measure_costs_pass,
             "time the graph's groups on the real devices (costs='measure' or a profile), after every "
             "rewrite the stages will run"),
    PassSpec("partition", partition_pass, "assign every node to a stage (ILP over measured or modelled times); "
             "rank 0 solves, every rank takes its answer"),
    PassSpec("coalesce_blocks", coalesce_blocks_pass,
             "neighbouring blocks of one split that landed on one stage merged back into one "
             "(one weight-slice backward per stage); after partition, which decides where they are"),
    PassSpec("split", split_pass, "cut the Program into one GraphModule per stage and the values between them"),
    PassSpec("vocab_head", vocab_head_pass,
             "config.vocab_passes: the LM head and its cross-entropy cut off the last stage, to run on "
             "every rank's block of the vocabulary (S/T passes); after split, before vocab_rows gives "
             "each rank its block"),
    PassSpec("vocab_rows", vocab_rows_pass,
             "a parameter a rank's stages read only as row slices (split LM-head blocks) held as those "
             "rows only (Yeung et al. 2025); after split, which decides the stages, and before recompute "
             "outlines regions"),
    PassSpec("recompute", recompute_pass,
             "activation recomputation per stage, after the split (a layer cut by a stage "
             "boundary is recomputed piecewise)"),
)


GRAPH_PASSES = ("canonicalize", "causal_mask", "tensor_parallel", "grouped_attention", "cost")
"""The graph passes every layout needs, by name: what ``run_passes`` runs by default."""
DEFAULT_PASSES: tuple[PassSpec, ...] = tuple(p for p in PIPELINE if p.name in GRAPH_PASSES)


def pass_names(passes: Sequence[PassSpec] = DEFAULT_PASSES) -> list[str]:
    return [p.name for p in passes]


def pipeline_names() -> list[str]:
    return pass_names(PIPELINE)
