"""Activation recomputation modes, torch-free: the planner prices them without torch,
the recompute pass (``passes/recompute.py``) applies them to stage graphs."""
from __future__ import annotations

from fxpipe.base.enums import NamedEnum


class RecomputeMode(NamedEnum, what="recompute mode"):
    NONE = "none"
    SELECTIVE = "selective"
    """Attention core only (Korthikanti et al. 2022 §4.1)."""
    FULL = "full"
    """Whole transformer layer; only its input is kept."""
