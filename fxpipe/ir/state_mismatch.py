"""One error for a set of tensors that does not match a model (checkpoints, weights)."""
from __future__ import annotations

from typing import Any, Mapping

from fxpipe.ir.program import ParamKind


def full_shapes(program: Any, specs: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Canonical name -> the tensor's whole shape (after the TP pass ``ParamInfo.shape``
    is the local shape; a sharded tensor's whole shape is its spec's ``full_shape``)."""

    return {p.canonical: tuple(specs[p.canonical].full_shape) if p.canonical in specs else tuple(p.shape)
            for p in program.params if p.kind is not ParamKind.CONSTANT}


def _show(xs: list[str]) -> str:
    return ", ".join(xs[:8]) + (f" (+{len(xs) - 8} more)" if len(xs) > 8 else "") if xs else "none"


def raise_if_mismatched(what: str, missing: list[str], unexpected: list[str], shapes: list[str]) -> None:
    """ValueError listing every missing / unexpected / mismatched (shape, dtype) tensor, or nothing."""
    if missing or unexpected or shapes:
        raise ValueError(f"{what}: missing: {_show(missing)}; unexpected: {_show(unexpected)}; "
                         f"mismatches: {_show(shapes)}. Was it saved from another model or config?")
