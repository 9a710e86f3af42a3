"""Training state per parameter: the one count both planners and the partition use.

A parameter costs its weight in the compute dtype, its gradient as reduced, and the
optimizer's state (Adam's two moments, and under mixed precision the fp32 master
weight); ZeRO-1 (``runtime/zero.py``) splits the optimizer state over the data-parallel
replicas, each owning about 1/dp of it. ``ParallelConfig.state_bytes_per_param_byte``
(the partition's memory model on the captured graph) and ``PlannerOptions.state_bytes``
(``fxpipe plan``'s) are this function with their precisions.
"""
from __future__ import annotations


def state_bytes(weight: float, gradient: float, total: float, *, zero: bool, dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter on one rank: ``weight`` and
    ``gradient`` bytes whole, the rest of ``total`` (the optimizer's) over ``dp`` under ZeRO-1."""
    return float(weight), float(gradient), (total - weight - gradient) / (dp if zero and dp > 1 else 1)
