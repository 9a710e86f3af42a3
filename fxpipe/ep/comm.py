"""The communication of expert parallelism: an all-to-all with uneven splits that
autograd differentiates, and the "current expert group" the graph's ops talk to.

Expert parallelism (GShard, Lepikhin et al. 2020 §2.2; Megatron-Core's MoE token
dispatcher) owns E/ep experts per rank of the expert group and moves each token to
the rank owning the expert the router chose, and back. The backward of an
all-to-all is the all-to-all with the splits swapped: the gradient of every row
returns to the rank it came from.

Like :func:`fxpipe.tp.tp_group_context`, the group is set by whoever runs the graph
(``expert_group_context``) and stored on the autograd node in forward, so backward
never reads the context. The group is any object with ``rank``, ``size`` and
``all_to_all(t, send, recv)`` (``fxpipe.tp.ProcessGroupTP`` over a process group of
the data-parallel ranks, or ``EmulatedGroup`` threads in tests).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ContextManager, Sequence

import torch

from fxpipe.base.current import CurrentValue


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return group.all_to_all(x, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.group.all_to_all(grad.contiguous(), ctx.recv, ctx.send), None, None, None


def all_to_all(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group: Any) -> torch.Tensor:
    """Rows ``send[r]`` of ``x`` (in order) to rank r, ``recv[r]`` rows from rank r, in
    rank order (``torch.distributed.all_to_all_single`` with uneven splits), differentiable."""
    assert len(send) == len(recv) == group.size and sum(send) == x.shape[0], (send, recv, tuple(x.shape))
    return _AllToAll.apply(x, tuple(int(n) for n in send), tuple(int(n) for n in recv), group)


@dataclass
class ExpertContext:
    group: Any
    """The expert-parallel group: ``ep`` ranks that together own every expert once."""
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    """MoE layer (its index among the graph's expert groups) -> tokens this rank routed
    to each expert (E,), summed over the forwards run in the context."""

    def record(self, layer: int, counts: torch.Tensor) -> None:
        counts = counts.detach().to("cpu", torch.int64)
        self.tokens[layer] = self.tokens[layer] + counts if layer in self.tokens else counts


_CURRENT: CurrentValue[ExpertContext] = CurrentValue(
    "fxpipe_ep_context", "an expert-parallel graph ran outside expert_group_context(...); wrap the call: "
    "`with fxpipe.ep.expert_group_context(group): program.run(state, *batch)`")


def expert_group_context(group: Any, context: ExpertContext | None = None) -> ContextManager[ExpertContext]:
    """Make ``group`` current for the expert-parallel ops of the graphs run inside.
    Pass the same ``context`` to every step to keep counting tokens per expert."""
    ctx = context if context is not None else ExpertContext(group)
    assert ctx.group is group, "an ExpertContext belongs to one group"
    return _CURRENT.scope(ctx)


def current_expert_context() -> ExpertContext:
    return _CURRENT.get()
