"""The API's layout search refusing a pin, inside a spawned gloo world (importable by the
children): what each rank raised, as (exception type, message)."""
from __future__ import annotations


def _refusal(**pins) -> tuple[str, str]:
    from fxpipe.models import build_workload
    from fxpipe.parallel import parallelize

    w = build_workload("gpt-tiny", batch=4, seq=16)
    try:
        parallelize(w.model, example_inputs=w.example_inputs, loss_fn=w.loss_fn, costs="model", **pins)
    except (ValueError, TypeError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return "nothing raised", ""


def ep_without_experts(rank: int, world: int) -> tuple[str, str]:
    return _refusal(ep=2)


def tiny_memory_limit(rank: int, world: int) -> tuple[str, str]:
    return _refusal(memory_limit_gb=1e-6)
