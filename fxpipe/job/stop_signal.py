"""Stopping a training job at a step boundary on SIGTERM / SIGINT, on every rank alike."""
from __future__ import annotations

import signal
from typing import Any

import torch
import torch.distributed as dist


class StopSignal:
    """SIGTERM / SIGINT (Ctrl-C) ask the job to stop at the next step boundary.

    The handler only records the signal; ranks then agree with an all-reduce, because
    a signal reaches each process at a different point and every rank must stop after
    the same step (a collective left half-done would hang). A repeated signal (the
    elastic agent forwards the one the terminal already sent) is ignored.

    Installed when training starts, not before: during set-up there is nothing to
    save, and a rank blocked there on a peer that crashed must die with the agent's
    SIGTERM at once (a Python handler would run only after the blocked call returns)."""

    def __init__(self) -> None:
        self.received = 0
        """Written by the handler only: it may run between any two bytecodes of ``agreed``."""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum

    def agreed(self) -> int:
        """The signal any rank received (0: none); the same answer on every rank."""
        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
