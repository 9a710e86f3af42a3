"""One cell of the compatibility matrix: run a family one way and say what happened.

Outcomes (``Cell.status``):

- ``pass``        same losses and first-step gradients as one process, within ``RTOL``;
- ``replicated``  a pass, but the tensor-parallel pass left weight matrices replicated
                  (correct, less parallel); the count and the reasons are listed;
- ``mismatch``    a silent wrong result: a defect;
- ``refused``     fxpipe raised its own explicit error (acceptable: it says why);
- ``error``       anything else (exception type and first line);
- ``timeout``     the family did not finish in time;
- ``skipped``     not run because an earlier column already failed.
"""
from __future__ import annotations

import os
import re
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import fxpipe
from compat_families import build, eager_loss, grad_rtol
from compat_render import generic_reason as _generic

RTOL = 1e-4
"""Losses: |got - ref| <= RTOL·|ref|. Gradients, per tensor: max|got - ref| <= RTOL·scale,
scale = max(max|ref|, FLOOR·largest |gradient| of the model): a gradient that is zero in
exact arithmetic (e.g. a key bias under softmax) holds only rounding noise, which a
different summation order changes completely. fp32 everywhere, dropout 0."""
FLOOR = 1e-3
LR = 0.1
STEPS = 2
MICROBATCHES = 2
_FXPIPE_DIR = os.path.dirname(fxpipe.__file__)


@dataclass
class Cell:
    status: str
    detail: str = ""
    seconds: float = 0.0
    replicated: list = field(default_factory=list)
    """(count, reason) of weight matrices left replicated by the TP pass."""
    share: float | None = None
    """tp cells: the largest TP rank's share of the model's parameters (ideal 1/tp)."""

    def to_json(self) -> dict:
        return asdict(self)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else "")[:200]


def classify(exc: BaseException, tb_text: str = "") -> Cell:
    """``refused`` for fxpipe's own explicit errors, ``error`` for everything else.

    ``tb_text``: the traceback as text, for an exception that crossed a process boundary
    (unpickling drops its traceback, and some exceptions' messages too)."""
    if tb_text and not exc.__traceback__:
        exc = _with_text(exc, tb_text)
    if isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError):
        return Cell("timeout", _first_line(exc.__cause__ or exc))
    if isinstance(exc, fxpipe.CaptureError):
        cause = exc.__cause__ or exc
        return Cell("refused", f"CaptureError ({type(cause).__name__}: {_first_line(cause)})")
    frames = traceback.extract_tb(exc.__traceback__)
    raised_by_fxpipe = bool(frames) and frames[-1].filename.startswith(_FXPIPE_DIR)
    if raised_by_fxpipe and isinstance(exc, (ValueError, TypeError, NotImplementedError)):
        return Cell("refused", f"{type(exc).__name__}: {_first_line(exc)}")
    where = _where([(f.filename, f.lineno) for f in frames]) or getattr(exc, "_compat_where", "")
    return Cell("error", f"{type(exc).__name__}: {_first_line(exc)}{where}")


def _where(frames: list[tuple[str, int | None]]) -> str:
    """' (at file:line)' of the innermost frame, and of the innermost fxpipe frame when
    that is another: torch raises most errors, the fxpipe line says which step hit it."""
    if not frames:
        return ""
    ours = [f for f in frames if f[0].startswith(_FXPIPE_DIR)]
    text = f"{os.path.basename(frames[-1][0])}:{frames[-1][1]}"
    if ours and ours[-1] != frames[-1]:
        text += f", from {os.path.relpath(ours[-1][0], _FXPIPE_DIR)}:{ours[-1][1]}"
    return f" (at {text})"


def _with_text(exc: BaseException, tb_text: str) -> BaseException:
    """``exc`` with the message and innermost frame read back from its traceback text."""
    files = re.findall(r'File "([^"]+)", line (\d+)', tb_text)
    exc._compat_where = _where([(f, int(n)) for f, n in files])
    if not _first_line(exc):
        tail = tb_text.split(f"{type(exc).__name__}: ", 1)
        if len(tail) == 2:
            exc.args = (tail[1].strip(),)
    return exc


def replicated_matrices(tp_result: Any) -> list[tuple[int, str]]:
    """Weight matrices (trainable, 2-D or more) the TP pass kept whole, grouped by reason.

    Norm weights, biases and buffers are replicated by design and not counted; nor
    are tables indexed by positions (Megatron keeps those whole too)."""
    reasons: Counter = Counter()
    for spec in tp_result.replicated():
        if len(spec.full_shape) < 2 or spec.reason.startswith("embedding indexed by values computed"):
            continue
        if spec.reason == "not read by the graph" or spec.reason.startswith("buffer "):
            continue
        reasons[_generic(spec.reason)] += 1
    return [(n, r) for r, n in reasons.most_common()]


def capture_cell(model_type: str) -> tuple[Cell, Cell | None]:
    """Capture in this process and check the captured loss against eager; then run the
    TP pass (tp=2) on the Program: its refusal or replicated report decides early what
    the tp columns can show. Returns (capture cell, TP analysis cell or None)."""
    import time

    from fxpipe.compiler.driver import run_passes
    from fxpipe.passes.tensor_parallel import TPConfig

    start = time.perf_counter()
    fam = build(model_type)
    try:
        program = fxpipe.capture(fam.model, fam.batch, fam.loss_fn)
    except Exception as exc:
        cell = classify(exc)
        cell.seconds = time.perf_counter() - start
        return cell, None
    with torch.no_grad():
        want = float(eager_loss(fam))
        got = float(program.run(program.state, *fam.batch))
    if not abs(got - want) <= RTOL * abs(want):
        return Cell("mismatch", f"captured loss {got:.6g} vs eager {want:.6g}",
                    time.perf_counter() - start), None
    cell = Cell("pass", f"{fam.num_params} parameters", time.perf_counter() - start)
    try:
        tp_program, _ = run_passes(program, TPConfig(tp=2))
    except Exception as exc:
        return cell, classify(exc)
    result = tp_program.tensor_parallel
    return cell, Cell("pass", replicated=replicated_matrices(result),
                      share=round(result.coverage.share, 4))


def compare(losses: list[float], grads: dict[str, torch.Tensor],
            ref_losses: list[float], ref_grads: dict[str, torch.Tensor], grad_tol: float = RTOL) -> str:
    """'' when equal within RTOL (gradients: ``grad_tol``), else the first difference
    with its numbers."""
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        if not abs(got - want) <= RTOL * abs(want):
            return f"step {step + 1} loss {got:.7g} vs {want:.7g} (rel {abs(got - want) / abs(want):.1e})"
    missing = sorted(set(ref_grads) - set(grads))
    if missing:
        return f"no gradient for {len(missing)} tensors, e.g. {missing[0]}"
    worst = (0.0, "", 0.0)
    floor = FLOOR * max((float(g.abs().max()) for g in ref_grads.values() if g.numel()), default=0.0)
    for name, want in ref_grads.items():
        got = grads[name]
        if got.shape != want.shape:
            return f"gradient of {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        scale = max(float(want.abs().max()) if want.numel() else 0.0, floor)
        err = float((got.float() - want).abs().max())
        rel = err / (scale + 1e-30)
        if rel > worst[0]:
            worst = (rel, name, err)
    if worst[0] > grad_tol:
        return f"gradient of {worst[1]}: max abs error {worst[2]:.2e} (rel {worst[0]:.1e})"
    return ""


def train_parallel(model_type: str, tp: int, pp: int, timeout_s: float, vocab_passes: bool = False) -> dict:
    """In a gloo world of tp·pp ranks: two SGD steps with fxpipe.parallelize (the LM head
    as vocabulary passes with ``vocab_passes``). Every rank returns its losses; global
    rank 0 also the full first-step gradients."""
    import torch.distributed as dist

    fam = build(model_type)
    pm = fxpipe.parallelize(fam.model, tp=tp, pp=pp, microbatches=MICROBATCHES, vocab_passes=vocab_passes,
                            example_inputs=fam.batch, loss_fn=fam.loss_fn, timeout_s=timeout_s)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        losses.append(pm.train_step(fam.batch))
        if step == 0:  # TP shards and pipeline ranks' rows (vocabulary passes) gathered whole
            grads = pm.gather_full({n: t.grad.detach().clone() for n, t in pm.named_parameters()
                                    if t.grad is not None})
        opt.step()
    out = {"losses": losses}
    if dist.get_rank() == 0:
        out["grads"] = grads
    return out
