"""Refusals decided on rank 0, run inside a spawned gloo world (importable by the children)."""
from __future__ import annotations


def world_refusals(rank: int, world: int) -> list[tuple[str, str]]:
    """(exception type, message) each rank raised: a decision rank 0 refuses, then the
    API's layout search refusing pins nothing fits."""
    from fxpipe.models import build_workload
    from fxpipe.parallel import parallelize
    from fxpipe.runtime.launch import rank0_decides

    out = []

    def refuse():
        raise ValueError("rank 0 says no: 3 is not 2")

    try:
        rank0_decides(refuse)
    except ValueError as exc:
        out.append((type(exc).__name__, str(exc)))
    w = build_workload("gpt-tiny", batch=4, seq=16)
    for pins in (dict(tp=3, pp="auto"), dict(pp=8, tp="auto")):
        try:
            parallelize(w.model, example_inputs=w.example_inputs, loss_fn=w.loss_fn, **pins)
        except (ValueError, TypeError, RuntimeError) as exc:
            out.append((type(exc).__name__, str(exc)))
    return out
