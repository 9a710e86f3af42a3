"""The communication side of tensor parallelism.

- ``group``: the :class:`TPGroup` protocol (rank, size, all_reduce, all_gather,
  reduce_scatter), :class:`ProcessGroupTP` over torch.distributed, and the
  in-process :class:`EmulatedGroup` with :func:`run_emulated` for tests;
- ``context``: :func:`tp_group_context`, the only "current group" mechanism,
  and :class:`DropoutRNG` (Megatron's RNG tracker);
- ``ops``: Megatron's f/g, sequence-parallel and vocabulary-parallel operators as
  ``torch.ops.fxpipe_tp.*`` graph ops (importing this package registers them);
- ``scatter_gather``: SC21 §4.1 helpers for the pipeline runtime.

The compiler pass that inserts these ops is :mod:`fxpipe.passes.tensor_parallel`.
"""
from fxpipe.tp import ops  # noqa: F401  (registers torch.ops.fxpipe_tp.*)
from fxpipe.tp.context import DropoutRNG, TPContext, current_tp, tp_group_context
from fxpipe.tp.group import EmulatedGroup, ProcessGroupTP, ReduceOp, ShapesOnlyGroup, TPGroup, run_emulated
from fxpipe.tp.scatter_gather import gather_chunks, inter_stage_bytes, scatter_chunk

__all__ = ["DropoutRNG", "EmulatedGroup", "ProcessGroupTP", "ReduceOp", "ShapesOnlyGroup", "TPContext", "TPGroup",
           "current_tp", "gather_chunks", "inter_stage_bytes", "run_emulated", "scatter_chunk",
           "tp_group_context"]
