"""Pipeline stage partitioning: the graph-independent solver core.

Typical use (the partition pass builds the fine graph from a Program)::

    coarse = coarsen(fine_graph, max_groups=300)
    problem = PartitionProblem(graph=coarse.graph, num_stages=p * v,
                               stage_to_rank=tuple(k % p for k in range(p * v)),
                               inflight=..., memory_limit_bytes=80 * 10**9,
                               bandwidth_bytes_per_s=25e9, latency_s=10e-6)
    result = partition(problem, "ilp")          # or uniform / params / dp
    stage_of_fine_node = coarse.expand(result.stage_of)

Nothing here imports torch.
"""
from fxpipe.partition.baselines import solve_params, solve_uniform
from fxpipe.partition.chain_dp import solve_chain_dp
from fxpipe.partition.coarsen import Coarsening, coarsen
from fxpipe.partition.ilp import solve_ilp
from fxpipe.partition.memory_floor import MemoryFloor, MemoryLimitError, memory_floor
from fxpipe.partition.problem import PartitionError, PartitionProblem
from fxpipe.partition.registry import partition
from fxpipe.partition.result import Method, PartitionResult, SolveStatus
from fxpipe.partition.stage_cost import StageCost, evaluate

__all__ = [
    "Coarsening", "MemoryFloor", "MemoryLimitError", "Method", "PartitionError", "PartitionProblem",
    "PartitionResult", "SolveStatus", "StageCost", "coarsen", "evaluate", "memory_floor", "partition",
    "solve_chain_dp", "solve_ilp", "solve_params", "solve_uniform",
]
