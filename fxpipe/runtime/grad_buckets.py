"""The data-parallel gradient reduction in buckets, started while backward still runs.

As torch's DistributedDataParallel (Li et al., VLDB 2020, §3.2.3) and Megatron-LM's
``--overlap-grad-reduce``: the trainable tensors are grouped into buckets of about
``bucket_mb`` MB in the order the step's backward finishes them; a bucket's
collective starts asynchronously as soon as every gradient in it is final, and the
step waits for the buckets only at its end, before the optimizer.

When a gradient is final: the executor runs a fixed action list, so the last action
that accumulates into a tensor is known before the step — the last B (or W, under
zero-bubble schedules, where B is split into I and W) of every stage of this rank
that reads it. Only during that action is the tensor's post-accumulate hook armed
(earlier microbatches' accumulations are not final); a tensor that got no gradient in
it (unused by the last microbatch) is final when the action returns. Buckets are
launched strictly in order, so every replica issues the same collectives in the same
order whatever order its hooks fire in.

Memory: each gradient *is* a view into its bucket's flat buffer (DDP's
``gradient_as_bucket_view``): autograd and the fp32-master hooks accumulate into it
in place and the collective reduces it in place — no second copy of the gradients.
Under mixed precision the buffers hold the fp32 master (or ZeRO holder) gradients:
the hooks here are registered after ``MasterWeights``' on the same compute leaves, so
they see the master's gradient complete.

The buckets are not zeroed before the step: a tensor's first gradient of the step
(autograd's own fresh tensor, which it needs anyway) is copied into its range and the
range becomes its ``.grad`` (``_adopt``), so the first microbatch writes instead of
accumulating into zeros; a tensor no gradient reached is zeroed when its bucket is
launched. Zeroing every bucket each step was one more pass over all the gradients'
bytes (and accumulating into the zeros one more read). Only the tables whose last
action accumulates into them more than once (``unhooked``) are zeroed up front.

With ZeRO-1 (``zero.py``) a bucket is laid out by owner, and each owner's run of it is
reduced onto that owner (the bytes of a reduce-scatter) instead of all-reduced — under
NCCL. Gloo has no ring reduce: its ``reduce`` onto one rank is slower than an all-reduce
of the same bytes (two processes on the 2-core VM: 25 MB 21.5 ms against 17.4, 64 MB 58.9
against 51.1; its ``reduce_scatter`` 26.5 and 102.3), so on a gloo group the bucket is
all-reduced whole and each replica keeps the runs it owns (``reduce_onto_owner``).

Tensors reduced over other groups than the data-parallel one (``grad_sync.py``: tied
copies and row-shared runs over the union of their pipeline ranks and the dp replicas,
expert stacks over the replicas of the same experts) ride in the same buckets: a
tensor's ``segments`` name the group each range of it is all-reduced on (``Bucket.others``),
started with the bucket. Every such collective is divided by dp like the rest, since
the group sums over the dp replicas too. A group whose members are different pipeline
ranks is never merged across segments: the ranks lay their buckets out differently, so
only one collective per segment issues the same calls on each of them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from fxpipe.schedules.actions import Action, ActionKind

DEFAULT_BUCKET_MB = 25.0
"""torch DDP's ``bucket_cap_mb``."""


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]
    """Canonical names, in buffer order (grouped by owner under ZeRO-1)."""
    runs: tuple[tuple[int, int, int], ...]
    """(owner's data-parallel rank or -1 for all, start, length) of each collective's slice."""
    numel: int
    dtype: torch.dtype
    others: tuple[tuple[int, int, int], ...] = ()
    """(index into ``OverlappedReduction.groups``, start, length) of each all-reduce over
    another group than the data-parallel one (module docstring)."""


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[Bucket, ...]
    final_at: Mapping[str, int]
    """Canonical name -> index of the action (in this rank's action list) whose end
    makes its gradient final."""


def final_actions(actions: Sequence[Action], stage_params: Mapping[int, Sequence[str]]) -> tuple[dict[str, int], dict[str, int]]:
    """(name -> index of the last action accumulating into it, name -> its order within
    that action's stage: later-read tensors first, as backward reaches them first)."""
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.kind in (ActionKind.B, ActionKind.W) and a.stage in stage_params:
            last[a.stage] = i
    final_at: dict[str, int] = {}
    order: dict[str, int] = {}
    for stage, names in stage_params.items():
        if stage not in last:
            continue
        for position, n in enumerate(names):
            if last[stage] >= final_at.get(n, -1):
                final_at[n], order[n] = last[stage], -position
    return final_at, order


def plan_buckets(final_at: Mapping[str, int], order: Mapping[str, int], numel: Mapping[str, int],
                 dtype: Mapping[str, torch.dtype], bucket_bytes: float,
                 owner: Mapping[str, int] | None = None,
                 segments: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
                 mergeable: frozenset[int] = frozenset()) -> BucketPlan:
    """Buckets of at most ``bucket_bytes`` (one tensor alone may exceed it) in the
    order the gradients become final: by action, then by ``order`` (smaller first:
    backward reaches a stage's last-used tensors first). ``segments``: name -> (group
    index, or -1 for the data-parallel group, offset, length) of each range of it (default:
    all of it on the data-parallel group); consecutive ranges of one ``mergeable`` group are
    reduced as one."""
    segments = segments or {}
    names = sorted(final_at, key=lambda n: (final_at[n], order[n], n))
    groups: list[list[str]] = []
    size = 0.0
    for n in names:
        nbytes = numel[n] * dtype[n].itemsize
        if not groups or size + nbytes > bucket_bytes or dtype[groups[-1][0]] != dtype[n]:
            groups.append([])
            size = 0.0
        groups[-1].append(n)
        size += nbytes
    buckets = []
    for group in groups:
        if owner is not None:  # one contiguous run per owner
            group = sorted(group, key=lambda n: owner[n])  # stable: keeps the finishing order per owner
        runs: list[list[int]] = []
        others: list[list[int]] = []
        start = 0
        for n in group:
            for key, offset, length in segments.get(n, ((-1, 0, numel[n]),)):
                at = start + offset
                if key < 0:
                    who = owner[n] if owner is not None else -1
                    if runs and runs[-1][0] == who and runs[-1][1] + runs[-1][2] == at:
                        runs[-1][2] += length
                    else:
                        runs.append([who, at, length])
                elif others and key in mergeable and others[-1][0] == key and others[-1][1] + others[-1][2] == at:
                    others[-1][2] += length
                else:
                    others.append([key, at, length])
            start += numel[n]
        buckets.append(Bucket(tuple(group), tuple(tuple(r) for r in runs), start, dtype[group[0]],
                              tuple(tuple(o) for o in others)))
    return BucketPlan(tuple(buckets), dict(final_at))


@dataclass
class OverlappedReduction:
    """One rank's buckets at run time (module docstring)."""
    plan: BucketPlan
    holders: Mapping[str, Any]
    """Canonical name -> what holds its gradient in ``.grad`` (``GradSync.state``)."""
    like: Mapping[str, torch.Tensor]
    """Canonical name -> its compute leaf (shape, device; its hooks are registered here)."""
    group: Any
    dp: int
    dp_rank: int
    timeout: timedelta
    global_rank: Callable[[int], int]
    """Data-parallel rank -> global rank (ZeRO-1's reduce destinations)."""
    owner: Mapping[str, int] | None = None
    """ZeRO-1: canonical name -> the data-parallel rank that owns it."""
    groups: Sequence[Any] = ()
    """The process groups ``Bucket.others`` index (None: no collective, the division only)."""
    unhooked: frozenset[str] = frozenset()
    """Names final only when their action returns: their last action may accumulate into
    them more than once (an embedding table's lookups, several microbatches' gradients
    taken at one point: ``lookup_exchange.py``), so the first hook is not the last."""
    reduce_onto_owner: bool = True
    """ZeRO-1: each owner's run reduced onto it (NCCL); False: the bucket all-reduced whole,
    the runs others own then dropped (gloo: ``ZeroPartition.reduces_onto_owner``)."""
    launched_at: list[float] = field(default_factory=list)
    """perf_counter of each bucket's launch in the last step (tests check it falls
    inside the backward)."""
    waited_s: float = 0.0
    """Time the last step blocked waiting for the buckets (exposed reduction)."""

    def __post_init__(self) -> None:
        self._bucket_of = {n: i for i, b in enumerate(self.plan.buckets) for n in b.names}
        self._at: dict[str, tuple[int, int]] = {}  # name -> (bucket, first element of its range)
        for i, b in enumerate(self.plan.buckets):
            start = 0
            for n in b.names:
                self._at[n] = (i, start)
                start += self.like[n].numel()
        self._by_action: dict[int, list[str]] = {}
        for n, index in self.plan.final_at.items():
            self._by_action.setdefault(index, []).append(n)
        self._buffers: list[torch.Tensor] = []
        self._works: list[Any] = []
        self._missing: list[int] = []
        self._done: set[str] = set()
        self._next = 0
        self._action: int | None = None
        self._written: set[str] = set()
        self._hooks = [self.like[n].register_post_accumulate_grad_hook(self._hook(n)) for n in self._bucket_of
                       if n not in self.unhooked]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._bucket_of)

    def _hook(self, name: str):
        final = self.plan.final_at[name]

        def hook(_: torch.Tensor) -> None:
            if name not in self._written:
                self._adopt(name)
            if self._action == final:
                self._final(name)
        return hook

    def _view(self, name: str) -> torch.Tensor:
        i, start = self._at[name]
        shape = self.like[name].shape
        return self._buffers[i].narrow(0, start, shape.numel()).view(shape)

    @torch.no_grad()
    def _adopt(self, name: str) -> None:
        """Make ``name``'s range of its bucket its ``.grad``: what it has so far copied in,
        zeros if nothing (module docstring)."""
        holder, view = self.holders[name], self._view(name)
        if holder.grad is None:
            view.zero_()
        elif holder.grad.data_ptr() != view.data_ptr():
            view.copy_(holder.grad)
        holder.grad = view
        self._written.add(name)

    def start_step(self) -> None:
        """Clear the gradients: each becomes its bucket's view at its first accumulation
        (``_adopt``); the ``unhooked`` tables are zeroed views from the start."""
        # A step refused after its backward (train_step's batch check) left its buckets in
        # flight: every replica launched the same ones, so they complete; drop them.
        for work in self._works:
            work.wait(self.timeout) if self._buffers[0].device.type == "cpu" else work.wait()
        self._works, self._action = [], None
        if not self._buffers:
            device = next(iter(self.like.values())).device
            self._buffers = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in self.plan.buckets]
        self._written = set()
        for n in self._bucket_of:
            self.holders[n].grad = None
            if n in self.unhooked:
                self._adopt(n)
        self._missing = [len(b.names) for b in self.plan.buckets]
        self._done = set()
        self._next = 0
        self.launched_at = []
        self.waited_s = 0.0

    def before_action(self, index: int) -> None:
        self._action = index

    def after_action(self, index: int) -> None:
        self._action = None
        for n in self._by_action.get(index, ()):
            self._final(n)  # no gradient reached it in its last action: final all the same

    def _final(self, name: str) -> None:
        if name in self._done:
            return
        self._done.add(name)
        self._missing[self._bucket_of[name]] -= 1
        while self._next < len(self._missing) and self._missing[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, i: int) -> None:
        buf = self._buffers[i]
        bucket = self.plan.buckets[i]
        for n in bucket.names:
            if n not in self._written:  # no gradient reached it this step (or not through a hook)
                self._adopt(n)
        for key, start, length in bucket.others:
            if self.groups[key] is not None:
                self._works.append(dist.all_reduce(buf.narrow(0, start, length), group=self.groups[key],
                                                   async_op=True))
        runs = bucket.runs if self.dp > 1 else ()  # one replica: nothing to reduce
        if not self.reduce_onto_owner:  # adjacent owners' runs: one all-reduce of their span
            runs = _spans(runs)
        for who, start, length in runs:
            part = buf.narrow(0, start, length)
            if who < 0:
                self._works.append(dist.all_reduce(part, group=self.group, async_op=True))
            else:
                self._works.append(dist.reduce(part, dst=self.global_rank(who), group=self.group, async_op=True))
        self.launched_at.append(time.perf_counter())

    @torch.no_grad()
    def finish(self) -> None:
        """Launch what is left, wait for every bucket, average; under ZeRO-1 drop the
        gradients this replica does not own."""
        for n in self.plan.final_at:
            self._final(n)
        start = time.perf_counter()
        works, self._works = self._works, []
        for i, work in enumerate(works):
            try:
                # Gloo honours a per-call timeout; NCCL's work objects take the group's.
                work.wait(self.timeout) if self._buffers[0].device.type == "cpu" else work.wait()
            except RuntimeError as exc:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: the data-parallel gradient reduction ({i + 1} of {len(works)} "
                    f"collectives) did not complete within {self.timeout.total_seconds():g} s: a data-parallel "
                    f"replica stopped or is far slower (--timeout sets the wait)") from exc
        self.waited_s = time.perf_counter() - start
        for bucket, buf in zip(self.plan.buckets, self._buffers):
            for who, at, length in bucket.runs:
                if self.dp > 1 and (who < 0 or who == self.dp_rank):
                    buf.narrow(0, at, length).mul_(1.0 / self.dp)
            for _key, at, length in bucket.others:
                if self.dp > 1:
                    buf.narrow(0, at, length).mul_(1.0 / self.dp)
        if self.owner is not None:
            for n in self._bucket_of:
                if self.owner[n] != self.dp_rank:
                    self.holders[n].grad = None  # reduced onto its owner; the bucket keeps the bytes


def _spans(runs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``runs`` with every adjacent pair merged: (-1, start, length) of each contiguous span."""
    spans: list[list[int]] = []
    for _, start, length in runs:  # in buffer order, as plan_buckets lays them out
        if spans and spans[-1][1] + spans[-1][2] == start:
            spans[-1][2] += length
        else:
            spans.append([-1, start, length])
    return [tuple(x) for x in spans]
