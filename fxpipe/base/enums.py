"""Parsing a user's name for an enum member: one function, so every kind refuses an
unknown name the same way (the name, then every valid one)."""
from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def parse_enum(cls: type[E], name: "str | E", what: str, valid: str = "valid") -> E:
    """``cls``'s member named ``name`` (any case; a member passes through), else a
    ``ValueError``: "unknown {what} 'x'; {valid}: a, b, c"."""
    if isinstance(name, cls):
        return name
    try:
        return cls(str(name).lower())
    except ValueError:
        raise ValueError(f"unknown {what} {name!r}; {valid}: {', '.join(k.value for k in cls)}") from None
