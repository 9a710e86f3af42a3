"""The vocabulary passes: every pipeline rank runs its block of the LM head (``VocabHead``).

The compiler cut the head and its cross-entropy off the last stage
(``passes/vocab_head.py``) and gave rank r rows [a_r, b_r) of the head's weight. Per
microbatch j, in the order the schedule lists them (``schedules/vocab_actions.py``):

- ``BCAST_H j``: the last stage's output — the head's input x and the class indices
  (and, for per-token losses reduced with a mask, each token's weight) — broadcast
  from its rank to every rank, as one buffer of their bytes;
- ``S j``: the rank's block of logits, ``linear(x, W_r, b_r)`` through the captured chain
  (views, casts, element-wise ops such as a softcap) to [N, b_r - a_r], kept with its
  autograd graph, and per token its max
  m_r, sum-exp s_r = Σ exp(l − m_r) and the target's logit (0 outside the block);
- ``ALLREDUCE_S j``: online softmax (Milakov & Gimelshein 2018) over the pp group: one
  all-gather of every block's statistics, then on each rank M = max_r m_r,
  Σ_r s_r·exp(m_r − M) and the picks summed; every rank then knows
  loss_t = M + log S − l_t,y_t (reduced as the captured loss: mean over non-ignored
  targets, sum, or Σ_t weight_t·loss_t);
- ``T j``: the block's softmax gradient (exp(l − M)/S − onehot, masked and scaled by
  the reduction and the step's loss scale) back through the block: autograd accumulates
  the gradient of the rank's rows (fp32-master hooks fire as for any gradient) and of
  its copy of x;
- ``REDUCE_G j``: the partial gradients of x summed onto the last stage's rank, whose
  backward of j starts from it.

Under tensor parallelism (``VocabHead.vocab_size`` set: the captured loss was the TP
pass's vocabulary-parallel cross-entropy) rank r's block is of its TP rank's rows, the
statistics are all-reduced over the TP group after the pipeline group, the TP padding
rows never win (-inf), and x's summed gradient goes on through the stage's
``copy_to_tp`` (or SP gather), whose backward sums it over the TP ranks.

Every collective runs on the pipeline group (and the TP group) with the step's timeout (``Transport.wait``
names the peer on a stall); the schedule lists them in one order on every rank.
Memory: a microbatch's block logits stay from its S to its T.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxpipe.base.packing import pack, packed_nbytes, unpack
from fxpipe.ir.loss_chain import Reduction, operand_params, replay
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.runtime.mesh import MeshGroups
from fxpipe.runtime.transport import Pending, Transport
from fxpipe.schedules.schedule import Schedule


@dataclass
class _Micro:
    hidden: torch.Tensor
    """This rank's copy of x (a leaf: T leaves its partial gradient in ``.grad``)."""
    target: torch.Tensor
    weight: torch.Tensor | None = None
    """Each token's weight in the loss (``VocabHead.token_weight``), or None."""
    logits: torch.Tensor | None = None
    stats: torch.Tensor | None = None
    """(3, N) before ALLREDUCE_S: max, sum-exp, target logit; after: M, S, pick summed."""
    partial: torch.Tensor | None = None


class HeadBlock:
    """This rank's block of the head (module docstring)."""

    def __init__(self, plan: PipelinePlan, schedule: Schedule, groups: MeshGroups, state: dict[str, torch.Tensor],
                 device: torch.device, transport: Transport, loss_scale: Callable[[], float],
                 losses: dict[int, float] | None) -> None:
        head = plan.vocab_head
        assert head is not None
        self.head, self.groups, self.device, self.transport = head, groups, device, transport
        self.weight = state[head.weight]  # rank r's rows: block r
        self.bias = state[head.bias] if head.bias is not None else None  # the same rows of the bias
        self.operands = {p: state[p] for p in operand_params(head.chain)}
        """The same rows of each parameter [V] the chain's element-wise ops read."""
        self.start, self.stop = head.blocks[groups.pp_rank]
        # Under TP the blocks are of this TP rank's rows, classes tp_rank·rows.. of the
        # vocabulary; the statistics are reduced over the TP group too.
        self.first = self.start + groups.tp_rank * head.blocks[-1][1] if head.vocab_size is not None else self.start
        """The vocabulary index of the block's first row."""
        self.padding = 0 if head.vocab_size is None else max(0, self.first + self.stop - self.start - head.vocab_size)
        """The block's last rows past the vocabulary (TP padding): never a class."""
        self.reduce_groups = [groups.pp_group] + ([groups.tp_group] if head.vocab_size is not None else [])
        assert self.weight.shape[0] == self.stop - self.start, (self.weight.shape, head.blocks)
        self.source = groups.pp_peer(schedule.stage_to_rank(plan.num_stages - 1))
        self.is_source = self.source == groups.rank
        self.specs = [plan.values[n].spec for n in head.outputs]  # hidden, target[, token weight]
        self.loss_scale = loss_scale
        """The runners' current loss scale (1/m, times the fp16 scaler's): T's gradient carries it."""
        self.losses = losses
        """The last stage's runner's per-microbatch losses, on its rank (None elsewhere)."""
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.micro: dict[int, _Micro] = {}
        self.contributed: list[tuple[Any, torch.Tensor, int]] = []
        """REDUCE_G contributions in flight (work, the tensor it reads, microbatch): a rank
        other than the root goes on without waiting for the sum (``reduce_g``)."""

    @property
    def idle(self) -> bool:
        return not self.outputs and not self.micro and not self.contributed

    def finish(self) -> None:
        """The step's end: every contribution to a REDUCE_G has been taken by the root."""
        for work, _partial, mb in self.contributed:
            self._wait(work, "reducing the head's input gradient", mb)
        self.contributed.clear()

    def put(self, mb: int, values: tuple[torch.Tensor, ...]) -> None:
        """The last stage's forward of ``mb`` produced the head's input, the targets (and
        the tokens' weights): ``VocabHead.outputs``."""
        self.outputs[mb] = values

    def _wait(self, work, what: str, mb: int) -> None:
        peer = self.source if not self.is_source else self.groups.pp_peer((self.groups.pp_rank + 1)
                                                                          % self.groups.mesh.pp)
        self.transport.wait(Pending(work, peer, f"{what} of microbatch {mb} (vocabulary passes)"))

    def bcast_h(self, mb: int) -> None:
        """The head's input, targets (and token weights) from the last stage's rank, in
        one broadcast of their bytes (``base/packing.py``): one collective's latency, not
        one per value."""
        specs = [(s.shape, s.dtype) for s in self.specs]
        if self.is_source:
            values = [t.contiguous() for t in self.outputs.pop(mb)]
            buf = pack(values)
        else:
            buf = torch.empty(packed_nbytes(specs), dtype=torch.uint8, device=self.device)
        self._wait(dist.broadcast(buf, src=self.source, group=self.groups.pp_group, async_op=True),
                   "broadcasting the head's input", mb)
        if not self.is_source:
            values = unpack(buf, specs)
        hidden, target, *weight = values
        self.micro[mb] = _Micro(hidden.detach().requires_grad_(True), target, *weight)

    def s(self, mb: int) -> None:
        """The block's logits and its statistics."""
        m = self.micro[mb]
        width = self.stop - self.start
        with torch.enable_grad():
            # the captured ops between the head and the loss (views, casts, element-wise), on the block
            # a head read through a dtype cast (``W.to(x.dtype)``) computes in the hidden's dtype:
            # the cast is seen through by the pass (``passes/weight_views.py``) and done here
            dtype = m.hidden.dtype
            logits = torch.nn.functional.linear(m.hidden, self.weight.to(dtype),
                                                self.bias.to(dtype) if self.bias is not None else None)
            m.logits = replay(self.head.chain, logits, width, self.operands)
        m.stats = block_statistics(m.logits, m.target, self.first, self.padding)

    def allreduce_s(self, mb: int) -> None:
        """Online softmax over the ranks' blocks; the loss on every rank."""
        m = self.micro[mb]
        stats = m.stats
        for group in self.reduce_groups:  # pipeline ranks, then TP ranks
            stats = self._combined(stats, group, mb)
        m.stats = stats
        top, both = stats[0], stats[1:]
        valid = m.target != self.head.ignore_index
        per = torch.where(valid, top + torch.log(both[0]) - both[1], 0.0)
        if m.weight is not None:  # per-token losses reduced with a mask: Σ_t weight_t·ce_t
            per = per * m.weight
        loss = per.sum() / valid.sum() if self.head.reduction == Reduction.MEAN else per.sum()
        if self.losses is not None:
            self.losses[mb] = float(loss)

    def _combined(self, stats: torch.Tensor, group: Any, mb: int) -> torch.Tensor:
        """(3, N) statistics of the blocks of ``group``'s ranks combined: one all-gather
        of every rank's (max, sum-exp, target logit), then on each rank M = max_r m_r,
        S = Σ_r s_r·exp(m_r − M) and the picks summed, in rank order (the same bits on
        every rank). Two all-reduces (the max, then the sums) cost two collectives'
        latency, twice an all-gather's on gloo (benchmarks/bench_gloo_latency.py)."""
        size = dist.get_world_size(group)
        if size == 1:
            return stats
        gathered = torch.empty((size * stats.shape[0], *stats.shape[1:]), dtype=stats.dtype, device=stats.device)
        self._wait(dist.all_gather_single(gathered, stats.contiguous(), group=group, async_op=True),
                   "all-gathering the softmax statistics", mb)
        ranks = gathered.view(size, *stats.shape)
        top = ranks[:, 0].amax(0)
        return torch.stack([top, (ranks[:, 1] * torch.exp(ranks[:, 0] - top)).sum(0), ranks[:, 2].sum(0)])

    def t(self, mb: int) -> None:
        """The block's backward: its rows' gradient and a partial gradient of x."""
        m = self.micro[mb]
        valid = m.target != self.head.ignore_index
        scale = self.loss_scale()
        if self.head.reduction == Reduction.MEAN:
            scale = scale / valid.sum().clamp(min=1)
        weight = valid.to(torch.float32) * (scale if m.weight is None else m.weight.float() * scale)
        grad = block_gradient(m.logits, m.stats, m.target, self.first, self.padding, weight)
        torch.autograd.backward([m.logits], [grad])
        m.partial = m.hidden.grad if m.hidden.grad is not None else torch.zeros_like(m.hidden)
        m.logits = None

    def reduce_g(self, mb: int) -> torch.Tensor | None:
        """The partial gradients of x summed onto the last stage's rank (its gradient there)."""
        m = self.micro.pop(mb)
        partial = m.partial.contiguous()
        work = dist.reduce(partial, dst=self.source, group=self.groups.pp_group, async_op=True)
        if self.is_source:
            self._wait(work, "reducing the head's input gradient", mb)
            return partial
        # A contributor does not wait for the root to take its part, as the schedule's
        # simulation has it (schedules/simulate.py), which is what the lookups' send and
        # gradient points are ordered by (runtime/lookup_exchange.py): waiting here could
        # block on a root that waits, in turn, for this rank's lookup gradient (GPipe,
        # m=8). Gloo runs the pp group's collectives in issue order, so the later ones queue.
        self.contributed.append((work, partial, mb))
        self.contributed = [c for c in self.contributed if not c[0].is_completed()]
        return None


# ---- the block's math, apart from the collectives (what the layout search times: costs/local.py) ----
def masked(logits: torch.Tensor, padding: int) -> torch.Tensor:
    """``logits`` (detached, fp32) with the last ``padding`` columns — TP padding rows,
    never a class — at -inf."""
    logits = logits.detach().float()
    if padding:
        logits = logits.clone()  # not the autograd graph's tensor
        logits[..., logits.shape[-1] - padding:] = float("-inf")
    return logits


@torch.no_grad()
def block_statistics(logits: torch.Tensor, target: torch.Tensor, first: int, padding: int) -> torch.Tensor:
    """Per token of a block of logits whose first column is class ``first``: its max, its
    sum-exp relative to that max, and the target's logit (0 outside the block), stacked."""
    width = logits.shape[-1]
    logits = masked(logits, padding)
    top = logits.max(-1).values
    # a block of padding only: no class, sum-exp 0 (its max, -inf, loses the max)
    sumexp = torch.exp(logits - torch.where(top == float("-inf"), 0.0, top).unsqueeze(-1)).sum(-1)
    local = target - first
    inside = (local >= 0) & (local < width)
    picked = logits.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    return torch.stack([top, sumexp, torch.where(inside, picked, 0.0)])


@torch.no_grad()
def block_gradient(logits: torch.Tensor, stats: torch.Tensor, target: torch.Tensor, first: int, padding: int,
                   weight: torch.Tensor) -> torch.Tensor:
    """The cross-entropy's gradient on a block of logits, given the all-reduced
    statistics (global max, sum-exp): softmax minus the target's one-hot, times each
    token's ``weight`` (its share of the reduction and the loss scale), in the logits' dtype."""
    top, total, _pick = stats
    width = logits.shape[-1]
    grad = torch.exp(masked(logits, padding) - top.unsqueeze(-1)) / total.unsqueeze(-1)
    local = target - first
    inside = ((local >= 0) & (local < width)).to(grad.dtype)
    grad.scatter_add_(-1, local.clamp(0, width - 1).unsqueeze(-1), -inside.unsqueeze(-1))
    return (grad * weight.unsqueeze(-1)).to(logits.dtype)
