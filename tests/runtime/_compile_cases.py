"""Compiled-vs-eager training cases run inside spawned gloo workers (importable by the children)."""
from __future__ import annotations

import os
import time
import warnings

from tests.runtime._cases import BATCH, MICROBATCHES, SEQ, train
from fxpipe.models import build_workload
from tests.runtime._reuse_capture import reusing_captures

STEPS = 2
LAYERS = 2
"""Two layers: Inductor compiles one kernel per distinct fused op and shape, so more
layers add trace time but hardly any C++ compilation (the expensive part)."""


def _train(case: dict, inductor: bool) -> dict:
    from fxpipe.parallel import parallelize

    w = build_workload(case["model"], batch=BATCH, seq=SEQ, layers=case.get("layers", LAYERS), seed=0)
    pm = parallelize(w.model, pp=case.get("pp", 1), tp=case.get("tp", 1), sp=case.get("sp", False),
                     microbatches=MICROBATCHES, schedule=case.get("schedule", "1f1b"), chunks=case.get("chunks"),
                     example_inputs=w.example_inputs, loss_fn=w.loss_fn, partition="uniform",
                     recompute=case.get("recompute", "none"), precision=case.get("precision", "fp32"),
                     inductor=inductor)
    losses, grads, _ = train(pm, w, STEPS)
    return dict(losses=losses, grads=grads, compiled=[(r.stage, r.compiled, r.reason) for r in pm.compiled_stages],
                split={r.stage: r.split for r in pm.compiled_stages}, collectives=_collectives(pm))


def _tp_ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "fxpipe_tp" in str(n.target)]


def _collectives(pm) -> dict[int, dict[str, list[str]]]:
    """Per stage whose compiled backward is split: the TP ops of the whole backward and
    of its I and W graphs, in graph order."""
    out = {}
    for s, runner in pm.executor.runners.items():
        parts = getattr(runner.compiled, "split", None)
        if parts is not None:
            out[s] = {k: _tp_ops(g) for k, g in
                      (("B", parts.backward), ("I", parts.input_graph), ("W", parts.weight_graph))}
    return out


def reference(case: dict) -> tuple[list[float], dict]:
    """The single-process model: per-step losses and the first step's gradients."""
    import torch

    w = build_workload(case["model"], batch=BATCH, seq=SEQ, layers=case.get("layers", LAYERS), seed=0)
    opt = torch.optim.AdamW(w.model.parameters(), lr=1e-3)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = w.loss_fn(w.model(*w.example_inputs[:-1]), w.example_inputs[-1]) if w.loss_fn is not None \
            else w.model(*w.example_inputs)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in w.model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads


@reusing_captures
def compiled_vs_eager(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case trained eagerly, then with ``inductor=True``; both results returned."""
    import torch._inductor.config as inductor_config

    # Scalar C++ kernels: these tests check how stages are compiled (collectives, I/W,
    # recompute tags), not Inductor's vectoriser, and on a cold cache probing the CPU's
    # vector ISAs costs more compiles than the stages themselves (CI budget).
    inductor_config.cpp.vec_isa_ok = False
    out = []
    for case in cases:
        start = time.perf_counter()
        eager = _train(case, inductor=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = _train(case, inductor=True)
        fallbacks = [str(w.message) for w in caught if "fxpipe compile" in str(w.message)]
        out.append(dict(case=case, eager=eager, compiled=compiled, fallbacks=fallbacks,
                        seconds=time.perf_counter() - start, pid=os.getpid()))
    return out
