"""Capture each model once per worker process in the multi-case test worlds.

``torch.export`` dominates the cost of a tiny-model case (~2 s of ~3 s on 4 processes
sharing 2 cores), and a world runs the same few models under many layouts. Inside
``captures_reused()``, the first capture of a model (its class, module tree, parameter
dtypes and the batch shapes) is kept pristine; later captures of an identical model
get a copy of that graph bound to their own parameters and buffers. What is reused is
exactly what ``capture`` would return again (export is deterministic); the first case
of each model in each world still captures for real, and tests/compiler/test_capture.py checks
capture itself against eager.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch


def _key(model: torch.nn.Module, inputs, loss_fn) -> tuple:
    tensors = [*model.parameters(), *model.buffers()]
    return (type(model).__qualname__, repr(model), getattr(loss_fn, "__qualname__", repr(loss_fn)),
            tuple((tuple(t.shape), t.dtype, t.device.type) for t in inputs),
            tuple((tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for t in tensors))


@contextlib.contextmanager
def captures_reused() -> Iterator[dict]:
    import fxpipe.compiler.pipeline as compiler

    original = compiler.capture
    pristine: dict[tuple, object] = {}

    def capture(model, example_inputs, loss_fn=None):
        key = _key(model, example_inputs, loss_fn)
        if key not in pristine:
            program = original(model, example_inputs, loss_fn)
            pristine[key] = program.replace(graph_module=copy.deepcopy(program.graph_module))
            return program
        kept = pristine[key]
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(model.named_buffers(remove_duplicate=False))
        # Lifted constants are not the model's tensors: they keep the captured value.
        state = {name: named.get(name, t) for name, t in kept.state.items()}
        return kept.replace(graph_module=copy.deepcopy(kept.graph_module), state=state)

    compiler.capture = capture
    try:
        yield pristine
    finally:
        compiler.capture = original


def reusing_captures(fn):
    """``fn`` (a world's worker entry) run inside ``captures_reused()``."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with captures_reused():
            return fn(*args, **kwargs)

    return run
