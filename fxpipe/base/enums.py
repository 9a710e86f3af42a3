"""Enums a user names (CLI flags, TOML keys, JSON fields): one parser, so every kind
refuses an unknown name the same way (the name, then every valid one)."""
from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound="NamedEnum")


class NamedEnum(enum.Enum):
    """Base of an enum whose members' values are the names users write. A subclass says
    how an error names it: ``class RecomputeMode(NamedEnum, what="recompute mode")``;
    the message reads "unknown {what} 'x'; {valid}: a, b, c" (``valid`` defaults to
    "valid")."""

    def __init_subclass__(cls, what: str = "", valid: str = "valid", **kwargs):
        super().__init_subclass__(**kwargs)
        # Plain class attributes: set after the class body, so they are not members.
        cls._what, cls._valid = what or cls.__name__, valid

    @classmethod
    def parse(cls: type[E], name: "str | E") -> E:
        """The member named ``name`` (any case; a member passes through), else a
        ``ValueError`` naming every valid value."""
        if isinstance(name, cls):
            return name
        try:
            return cls(str(name).lower())
        except ValueError:
            valid = ", ".join(k.value for k in cls)
            raise ValueError(f"unknown {cls._what} {name!r}; {cls._valid}: {valid}") from None
