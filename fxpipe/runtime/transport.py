"""Point-to-point transfers between pipeline ranks, with shapes known from the plan.

No metadata is exchanged at run time: the receiver allocates its buffer from the
plan's ``StageValue.spec``; the sender checks that what it sends matches the plan,
so a mismatch is a clear error at its source instead of a hang or garbage.

Sends are posted non-blocking (``isend``) and completed at the end of the step;
receives are posted when the schedule says (``RECV_*``) and waited on just before
the compute that reads them. With non-blocking sends, no posting order between
two ranks can deadlock as long as the compute order is a valid schedule.

Tags identify (direction, value, microbatch) so two streams between one pair of
ranks (forward activations and backward gradients, or several chunks with
interleaving) never match the wrong message.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.ir.stage_plan import StageValue
from fxpipe.tp.group import TPGroup
from fxpipe.tp.scatter_gather import gather_chunks, scatter_chunk


class TransferError(RuntimeError):
    """A tensor about to cross ranks does not match the plan."""


class PeerError(RuntimeError):
    """A transfer with ``peer`` did not complete: the peer stalled (timed out) or went
    away. The message names the peer, not just this rank, because the rank that
    reports a hang is the one that was *waiting*, not the one that stopped."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


@dataclass(frozen=True)
class Pending:
    """A posted transfer and whom it is with (the global rank of the peer)."""
    work: Any
    peer: int
    what: str
    """'receiving activation 'x' of microbatch 2' and the like, for messages."""


def check_spec(value: StageValue, t: torch.Tensor, what: str) -> None:
    if tuple(t.shape) != value.spec.shape or t.dtype != value.spec.dtype:
        raise TransferError(
            f"{what} {value.name!r} (stage {value.producer} -> {list(value.consumers)}) has shape "
            f"{tuple(t.shape)} {t.dtype}, the plan expects {value.spec.shape} {value.spec.dtype}; "
            f"every microbatch must have the shape of the example batch given to parallelize()")


@dataclass
class Transport:
    device: torch.device
    timeout: timedelta
    value_ids: dict[str, int]
    num_values: int
    group: Any = None
    """Process group the ranks below belong to (None: the default world group)."""
    scatter_gather: TPGroup | None = None
    """With tensor parallelism (SC21 §4.1): a value replicated over the tp group is sent
    as this rank's 1/t chunk and all-gathered over the group on arrival."""
    _sends: list[Any] = field(default_factory=list)
    waited_s: float = 0.0
    """Time blocked in ``wait`` since the executor last reset it (exposed communication)."""
    posted_s: float = 0.0
    """Time spent posting sends and receives since the executor last reset it. Posting
    is not free and not steady: gloo's ``isend``/``irecv`` takes the connection's lock,
    which its transport thread holds while it reads a message, and on a CPU whose cores
    all compute that thread waits for a core — a post then blocks for milliseconds
    (``benchmarks/bench_transfer_posts.py``). ``fxpipe calibrate`` prices its mean."""
    posted_cpu_s: float = 0.0
    """The posting thread's own CPU time in those posts (``time.thread_time``): the part of
    ``posted_s`` not spent blocked behind the transport thread or waiting for a core."""
    posts: int = 0
    """Sends and receives posted since the last reset."""

    def _chunked(self, value: StageValue) -> bool:
        return self.scatter_gather is not None and value.tp_replicated

    def tag(self, backward: bool, value: str, mb: int) -> int:
        return (mb * self.num_values + self.value_ids[value]) * 2 + int(backward)

    def send(self, value: StageValue, t: torch.Tensor, dst: int, tag: int) -> None:
        if self._chunked(value):
            g = self.scatter_gather
            t = scatter_chunk(t, g.rank, g.size)
        self._sends.append(Pending(self.post_send(t.contiguous(), dst, tag), dst,
                                   f"sending {self._describe(value, tag)} to rank {dst}"))

    def post_send(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        """``isend`` of ``t`` on this transport's group, its posting counted (``posted_s``)."""
        return self._post(dist.isend, t, dst=dst, tag=tag, group=self.group)

    def _post(self, post, *args, **kwargs) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return post(*args, **kwargs)
        finally:
            self.posted_s += time.perf_counter() - start
            self.posted_cpu_s += time.thread_time() - cpu
            self.posts += 1

    def recv(self, value: StageValue, src: int, tag: int) -> tuple[Pending, torch.Tensor]:
        shape: tuple[int, ...] = value.spec.shape
        if self._chunked(value):
            numel = 1
            for d in shape:
                numel *= d
            shape = (-(-numel // self.scatter_gather.size),)
        buf = torch.empty(shape, dtype=value.spec.dtype, device=self.device)
        return Pending(self._post(dist.irecv, buf, src=src, tag=tag, group=self.group), src,
                       f"receiving {self._describe(value, tag)} from rank {src}"), buf

    def _describe(self, value: StageValue, tag: int) -> str:
        mb, backward = tag // 2 // self.num_values, tag % 2  # inverts ``tag``
        return f"{'the gradient of ' if backward else ''}{value.name!r} (microbatch {mb})"

    def finish(self, value: StageValue, buf: torch.Tensor, backward: bool = False) -> torch.Tensor:
        """The full received tensor (all-gathering the chunks under scatter-gather), in
        the producer's memory layout for activations (``StageValue.stride``)."""
        if self._chunked(value):
            buf = gather_chunks(buf, self.scatter_gather, value.spec.shape)
        if value.stride is not None and not backward:
            laid = torch.empty_strided(value.spec.shape, value.stride, dtype=buf.dtype, device=buf.device)
            buf = laid.copy_(buf)
        return buf

    def wait(self, pending: Pending) -> None:
        start = time.perf_counter()
        try:
            self._wait(pending)
        finally:
            self.waited_s += time.perf_counter() - start

    def _wait(self, pending: Pending) -> None:
        # Gloo honours a per-call timeout; a peer that died never completes its send.
        try:
            if self.device.type == "cpu":
                pending.work.wait(self.timeout)
            else:
                pending.work.wait()
        except RuntimeError as exc:
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                why = (f"timed out after {self.timeout.total_seconds():g} s: rank {pending.peer} did "
                       f"not answer (stopped, stuck or far slower; --timeout sets the wait)")
            else:
                why = f"rank {pending.peer} went away (it exited or crashed; see its own error)"
            raise PeerError(f"rank {dist.get_rank()} {pending.what}: {why} [{detail}]",
                            pending.peer) from exc

    def flush_sends(self) -> None:
        for work in self._sends:
            self.wait(work)
        self._sends.clear()
