"""A value current for a block of code: set by whoever runs the block, read by what runs
inside it, with no global fallback.

The tensor- and expert-parallel graph ops talk to "the current group" (``tp/context.py``,
``ep/comm.py``). A ``contextvars.ContextVar`` holds it, so every thread (an emulated rank)
sees only what it set itself, and a block puts back what was current before it, error or
not. Reading it outside any block is an error whose message names the fix."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class CurrentValue(Generic[T]):
    """One such value; ``outside``: the ``RuntimeError``'s message when it is read outside
    any block (what to wrap the call in)."""

    def __init__(self, name: str, outside: str) -> None:
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(name, default=None)
        self._outside = outside

    @contextlib.contextmanager
    def scope(self, value: T) -> Iterator[T]:
        """``value`` is current inside the ``with`` block (which receives it)."""
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)

    def get(self) -> T:
        value = self._var.get()
        if value is None:
            raise RuntimeError(self._outside)
        return value

    def get_or_none(self) -> T | None:
        """For code that works with and without a current value."""
        return self._var.get()
