"""Tensor-parallel groups: the three collectives TP needs, behind one small protocol
(plus ``all_to_all`` with uneven splits, for expert parallelism's groups: ``fxpipe/ep``).

Three implementations:

- :class:`ProcessGroupTP` wraps a real ``torch.distributed`` process group (NCCL on
  GPUs, gloo on CPUs): what the runtime uses.
- :class:`ShapesOnlyGroup` is one rank with no peers, returning the real collectives'
  shapes: what times a shard's compute in one process.
- :class:`EmulatedGroup` runs every TP rank in a thread of one process and makes
  the collectives rendezvous at a barrier. Tests use it: all ranks' graphs run in
  about the time of one, with no process spawn (docs/tensor_parallel.md:
  collectives are autograd-aware graph ops).

Every collective returns a new tensor and never modifies its input, so autograd
code can call them on saved tensors. Results are bitwise identical on all ranks
(reductions add in rank order), which keeps replicated activations identical.
"""
from __future__ import annotations

import enum
import functools
import threading
from typing import Any, Callable, Protocol, Sequence, TypeVar, runtime_checkable

import torch

T = TypeVar("T")


class ReduceOp(enum.Enum):
    SUM = "sum"
    MAX = "max"


@runtime_checkable
class TPGroup(Protocol):
    """The tensor-parallel group of one rank, as the graph's collective ops see it."""

    @property
    def rank(self) -> int:
        """This rank's index in the group, 0..size-1 (its ``tp_rank``)."""
        ...

    @property
    def size(self) -> int:
        """Number of TP ranks ``tp``."""
        ...

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim``, in rank order."""
        ...

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over ranks, then keep this rank's ``1/size`` chunk along ``dim``."""
        ...


class _Ranked:
    """``rank`` and ``size`` as :class:`TPGroup` reads them, set once by each group."""
    _rank: int
    _size: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self._rank}, size={self._size})"


class ProcessGroupTP(_Ranked):
    """A :class:`TPGroup` over a ``torch.distributed`` process group."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist
        self._dist = dist
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        out = t.detach().clone(memory_format=torch.contiguous_format)
        red = self._dist.ReduceOp.SUM if op is ReduceOp.SUM else self._dist.ReduceOp.MAX
        self._dist.all_reduce(out, op=red, group=self.group)
        return out

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        # The flat collectives work along dim 0: move ``dim`` first and back.
        src = t.detach().movedim(dim, 0).contiguous()
        out = src.new_empty((src.shape[0] * self._size, *src.shape[1:]))
        # all_gather_single from torch 2.13 (its predecessor warns there); older: *_into_tensor.
        gather = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        gather(out, src, group=self.group)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        src = t.detach().movedim(dim, 0).contiguous()
        assert src.shape[0] % self._size == 0, (tuple(t.shape), dim, self._size)
        out = src.new_empty((src.shape[0] // self._size, *src.shape[1:]))
        scatter = getattr(self._dist, "reduce_scatter_single", None) or self._dist.reduce_scatter_tensor
        scatter(out, src, group=self.group)
        return out.movedim(0, dim).contiguous()

    def all_to_all(self, t: torch.Tensor, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
        """Rows ``send[r]`` of ``t`` (in order) go to rank r; ``recv[r]`` rows come from it."""
        src = t.detach().contiguous()
        out = src.new_empty((sum(recv), *src.shape[1:]))
        self._dist.all_to_all_single(out, src, output_split_sizes=list(recv), input_split_sizes=list(send),
                                     group=self.group)
        return out


class ShapesOnlyGroup(_Ranked):
    """Rank 0 of a group of ``size`` that no peer joins: each collective returns a tensor
    of the shape the real one returns, from this rank's data alone (an all-reduce copies,
    an all-gather repeats, a reduce-scatter keeps this rank's chunk).

    What it is for: timing one tp rank's compute at its shard shapes in a single process
    (the layout search, ``fxpipe/costs/local.py``), the communication priced apart on the
    links. The values are not any rank's real values; timing depends on shapes only."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a group needs size >= 1, got {size}")
        self._rank, self._size = 0, size

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        return t.detach().clone(memory_format=torch.contiguous_format)

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([t.detach()] * self._size, dim=dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        assert t.shape[dim] % self._size == 0, (tuple(t.shape), dim, self._size)
        return t.detach().narrow(dim, 0, t.shape[dim] // self._size).contiguous()

    def all_to_all(self, t: torch.Tensor, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
        src = t.detach().contiguous()
        rows = sum(recv)
        return src.new_zeros((rows, *src.shape[1:])) if rows != src.shape[0] else src.clone()


class _Rendezvous:
    """Where the threads of one emulated group meet: a slot per rank and a barrier.

    ``exchange`` waits twice: once until every rank has written its slot, once
    until every rank has read them all, so the next collective cannot overwrite
    a slot still being read."""

    def __init__(self, size: int, timeout: float) -> None:
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class EmulatedGroup(_Ranked):
    """One rank of a TP group emulated by threads of this process.

    Make the ranks together with :meth:`create` and run one thread per rank
    (:func:`run_emulated` does both)."""

    def __init__(self, rank: int, size: int, rendezvous: _Rendezvous) -> None:
        self._rank = rank
        self._size = size
        self._rv = rendezvous

    @staticmethod
    def create(size: int, timeout: float = 120.0) -> list["EmulatedGroup"]:
        if size < 1:
            raise ValueError(f"an emulated TP group needs size >= 1, got {size}")
        rv = _Rendezvous(size, timeout)
        return [EmulatedGroup(r, size, rv) for r in range(size)]

    def abort(self) -> None:
        """Release the other ranks' waits (they raise ``BrokenBarrierError``)."""
        self._rv.barrier.abort()

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._rv.exchange(self._rank, t.detach())

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        parts = self._exchange(t)
        if op is ReduceOp.SUM:
            return functools.reduce(torch.add, parts[1:], parts[0].clone())
        return functools.reduce(torch.maximum, parts[1:], parts[0].clone())

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = self._exchange(t)
        total = functools.reduce(torch.add, parts[1:], parts[0].clone())
        assert total.shape[dim] % self._size == 0, (tuple(t.shape), dim, self._size)
        return total.chunk(self._size, dim=dim)[self._rank].contiguous()

    def all_to_all(self, t: torch.Tensor, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
        parts = self._exchange(t)
        starts = [sum(r_send[:self._rank]) for r_send in self._rv.exchange(self._rank, list(send))]
        pieces = [p.narrow(0, a, n) for p, a, n in zip(parts, starts, recv)]
        return torch.cat(pieces).clone() if pieces else t.new_empty((0, *t.shape[1:]))


def run_emulated(size: int, fn: Callable[[EmulatedGroup], T], *,
                 timeout: float = 120.0) -> list[T]:
    """Run ``fn(group)`` for every rank of an emulated group, one thread each.

    Returns the results in rank order. If any rank raises, the others are released
    from their collectives and the first error (by rank) is re-raised. ``fn``
    enters the group context itself::

        def step(group):
            with tp_group_context(group):
                loss = program.run(shard_state(full, specs, group.rank), *batch)
                loss.backward()
            return loss
        losses = run_emulated(2, step)
    """
    groups = EmulatedGroup.create(size, timeout)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(groups[rank])
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors[rank] = exc
            groups[rank].abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}") for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    first = _first_error(errors)
    if first is not None:
        raise first
    return results


def _first_error(errors: Sequence[BaseException | None]) -> BaseException | None:
    # A rank released by another's abort raises BrokenBarrierError: report the cause.
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        return real[0]
    return next((e for e in errors if e is not None), None)
