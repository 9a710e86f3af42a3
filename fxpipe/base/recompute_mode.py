"""Activation recomputation modes, torch-free: the planner prices them without torch,
the recompute pass (``passes/recompute.py``) applies them to stage graphs."""
from __future__ import annotations

import enum

from fxpipe.base.enums import parse_enum


class RecomputeMode(enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    """Attention core only (Korthikanti et al. 2022 §4.1)."""
    FULL = "full"
    """Whole transformer layer; only its input is kept."""

    @classmethod
    def parse(cls, name: "str | RecomputeMode") -> "RecomputeMode":
        return parse_enum(cls, name, "recompute mode")
