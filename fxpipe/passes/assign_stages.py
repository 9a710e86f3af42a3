"""Stage assignment: every node of a Program given a pipeline stage (the partition
pass's solve, ``passes/partition.py``).

Builds the graph-independent problem of ``fxpipe.partition`` from the Program
(one fine node per compute op; side values that every stage recomputes are left
out), coarsens it by module path and cheap chains, solves it with the chosen
method (CP-SAT ILP by default) and writes ``Program.stages``.
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import torch

from fxpipe.ir.op_tables import VIEW_OPS
from fxpipe.ir.pass_configs import PartitionConfig
from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.sizes import is_dynamic
from fxpipe.partition import Method, PartitionError, PartitionProblem, PartitionResult, coarsen, partition
from fxpipe.partition.memory_floor import MemoryLimitError, gib
from fxpipe.passes.recompute import recompute_pricing
from fxpipe.passes.split import side_values


def build_problem_graph(program: Program, config: PartitionConfig) -> nx.DiGraph:
    """Fine DAG: one node per compute op, with times, bytes and layer index.

    A parameter's state bytes go to every op that reads it: the stage that runs the
    op must hold the parameter. That is what makes a tied embedding / LM head cost
    memory at both ends of the pipeline (a parameter read by two ops of one stage
    is counted twice, which only over-estimates)."""
    hw = config.hardware
    side = side_values(program)
    params = {p.node: p for p in program.params if p.kind is ParamKind.PARAMETER}
    # An expert-parallel rank holds E/ep of each stacked expert weight (passes/expert_parallel.py).
    ep = program.expert_parallel
    owners = {name: ep.ep for name in ep.specs} if ep is not None else {}
    g = nx.DiGraph()
    counted: set[str] = set()
    recompute = recompute_pricing(program.graph_module, program.layers, config.recompute,
                                  {k: c.out_bytes for k, c in program.costs.items()})
    for node in program.graph.nodes:
        if node.op != "call_function" or node.name in side:
            continue
        cost = program.costs[node.name]
        read = [params[a.name] for a in node.all_input_nodes if a.name in params]
        static = sum(p.nbytes // owners.get(p.canonical, 1) for p in read
                     if p.canonical not in config.spread) * config.state_bytes_per_param_byte
        # Parameter *count* once per tensor (the DeepSpeed baseline balances counts).
        count = sum(p.numel // owners.get(p.canonical, 1) for p in read if p.canonical not in counted)
        counted.update(p.canonical for p in read)
        fwd, bwd = (config.node_times[node.name] if config.node_times is not None
                    else (hw.forward_s(cost), hw.backward_s(cost)))
        away = node.name in config.elsewhere
        if away:
            fwd, bwd, static = 0.0, 0.0, 0.0
        act = 0 if away or node.target in VIEW_OPS else cost.out_bytes
        if node.name in recompute.recomputed:  # backward runs its forward again and keeps nothing
            bwd, act = bwd + config.recompute_runs * fwd, recompute.kept_inputs.get(node.name, 0)
        g.add_node(node.name, fwd=fwd, bwd=bwd,
                   static_bytes=static,
                   act_bytes=act * config.activation_scale,
                   out_bytes=cost.out_bytes, params=count,
                   layer=program.layers.get(node.name), key=program.module_paths.get(node.name),
                   # A data-dependent shape never crosses stages (coarsen keeps it with its readers),
                   # nor a complex value (rotary written with complex numbers): the transports
                   # send real tensors, and the gradient of a complex one would need its own path.
                   pinned=is_dynamic(node.meta.get("val")) or _is_complex(node.meta.get("val")))
        for arg in node.all_input_nodes:
            if arg.name in g:
                g.add_edge(arg.name, node.name)
    return g


def _is_complex(val) -> bool:
    if isinstance(val, (tuple, list)):
        return any(_is_complex(v) for v in val)
    return isinstance(val, torch.Tensor) and val.dtype.is_complex


def spread_bytes_per_rank(program: Program, config: PartitionConfig) -> int:
    """State bytes of ``config.spread`` that every pipeline rank holds: an even share."""
    seen = {p.canonical: p.nbytes for p in program.params
            if p.kind is ParamKind.PARAMETER and p.canonical in config.spread}
    ranks = len(set(config.stage_to_rank))
    return int(-(-sum(seen.values()) * config.state_bytes_per_param_byte // ranks))


def solve_partition(program: Program, config: PartitionConfig) -> tuple[dict[str, int], PartitionResult]:
    """Stage of every compute node, and the solver's result on the coarse problem."""
    if not program.costs:
        raise ValueError("the partition pass needs costs: run the cost pass first")
    fine = build_problem_graph(program, config)
    coarse = coarsen(fine, config.max_groups)
    # Rows every rank holds whatever the split: the solver sees the limit less them, and
    # the result's per-rank memory has them added back.
    base = spread_bytes_per_rank(program, config)
    limit = config.memory_limit_bytes
    if limit is not None and base >= limit:
        raise ValueError(f"memory_limit_gb={limit / 2**30:.3g} is below the {gib(base)} of vocabulary rows "
                         f"every rank holds under vocab_passes ({base} B per rank); raise the limit or add ranks")
    problem = PartitionProblem(graph=coarse.graph, num_stages=config.num_stages,
                               stage_to_rank=config.stage_to_rank, inflight=config.inflight,
                               memory_limit_bytes=None if limit is None else limit - base,
                               bandwidth_bytes_per_s=config.link[1] if config.link else config.hardware.p2p_bw,
                               latency_s=config.link[0] if config.link else config.hardware.p2p_latency)
    options = {}
    if config.method is Method.ILP:
        options = dict(time_limit_s=config.time_limit_s, seed=config.seed,
                       num_workers=config.num_workers, memory_tiebreak=config.memory_tiebreak)
    try:
        result = partition(problem, config.method, **options)
    except MemoryLimitError as e:
        raise PartitionError(f"{e} (limits here exclude the {gib(base)} of vocabulary rows every rank "
                             f"also holds)" if base else str(e)) from e
    if base:
        result = dataclasses.replace(result, rank_memory_bytes=tuple(b + base for b in result.rank_memory_bytes),
                                     memory_limit_bytes=limit)
    if not result.fits_memory and not config.allow_over_limit:
        raise PartitionError(over_limit_message(result))
    return coarse.expand(result.stage_of), result


def over_limit_message(result: PartitionResult) -> str:
    """Why a plan over the limit is refused, with each rank's peak and its stages'."""
    limit = result.memory_limit_bytes
    over = [(r, b) for r, b in enumerate(result.rank_memory_bytes) if b > limit]
    ranks = "; ".join(
        f"rank {r}: {gib(b)} (" + ", ".join(
            f"stage {c.stage}: {gib(c.static_bytes)} static + {c.inflight} x "
            f"{gib(c.act_bytes)} activations" for c in result.stages if c.rank == r) + ")"
        for r, b in over)
    why = ("found no contiguous split under it" if result.method is Method.DP
           else "does not take memory into account")
    return (f"partition {result.method.value!r} gives a plan over the memory limit of "
            f"{gib(limit)} per rank ({limit} B): {ranks}. {result.method.value} {why}; "
            f"partition 'ilp' honours the limit (or reports the smallest "
            f"that fits). Raise the limit, use ilp, or allow_over_limit=True "
            f"(fxpipe compile --allow-over-limit) to see this plan anyway")


def assign_stages(program: Program, config: PartitionConfig) -> Program:
    """``program`` with its stages and the solver's result (``solve_partition``)."""
    assignment, result = solve_partition(program, config)
    return program.replace(stages=assignment, partition=result)
