"""What activation recomputation costs: fxpipe's regions against torch.utils.checkpoint.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_recompute.py [--rounds 25] [--models deep-narrow gpt-tiny ...]

One process, one thread: each model captured at 8 rows × 32 tokens (a rank's share of
bench_auto_layout.py's memory-limited workload), its whole graph run forward and backward
- without recomputation,
- with every layer's (``full``) or attention core's (``selective``) regions run through
  ``torch.utils.checkpoint(use_reentrant=False)`` (what ``CheckpointedRegion`` ran before),
- with fxpipe's regions (``ir/recompute_region.py``: one autograd node per region),
in interleaved rounds (the three systems in turn each round), medians of wall time after
three warm-up rounds, freed blocks kept as in every runtime process (``base/cpu_memory.py``). "ideal" is the step without recomputation plus one more forward of
what the regions hold (the forward of the step without recomputation, timed alone: an
upper bound for ``full``, whose regions are the layers, not the embedding and head).
Writes benchmarks/results/bench_recompute.txt.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_auto_layout import workload  # noqa: E402

from fxpipe.base.cpu_memory import keep_freed_blocks  # noqa: E402
from fxpipe.compiler.capture import capture  # noqa: E402
from fxpipe.ir.recompute_region import CheckpointedRegion  # noqa: E402
from fxpipe.passes.recompute import RecomputeMode, apply_recompute, regions_of  # noqa: E402

MODELS = ("deep-narrow", "gpt-tiny", "zoo:llama3", "hf:gpt2")
OUT = Path(__file__).resolve().parent / "results" / "bench_recompute.txt"


class _TorchCheckpoint(CheckpointedRegion):
    """A region run through torch.utils.checkpoint, as fxpipe's regions ran before."""

    def forward(self, *args: object) -> tuple:
        return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True)


def _with_torch_checkpoint(gm: fx.GraphModule) -> fx.GraphModule:
    for name, mod in list(gm.named_children()):
        if isinstance(mod, CheckpointedRegion):
            setattr(gm, name, _TorchCheckpoint(mod.body))
    return gm


def _case(name: str, rows: int, seq: int):
    w = workload(name, rows, seq)
    prog = capture(w.model, w.example_inputs, w.loss_fn)
    state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in prog.state.items()}
    args = [state[p.canonical] for p in prog.params] + list(w.example_inputs)

    def step(gm: fx.GraphModule, backward: bool = True) -> float:
        t0 = time.perf_counter()
        out = gm(*args)
        loss = out[prog.loss_output] if isinstance(out, (tuple, list)) else out
        if backward:
            loss.backward()
        t = time.perf_counter() - t0
        for v in state.values():
            v.grad = None
        return t
    return prog, step


def _fresh(gm: fx.GraphModule) -> fx.GraphModule:
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def measure(name: str, mode: RecomputeMode, rounds: int, rows: int = 8, seq: int = 32) -> dict[str, float]:
    prog, step = _case(name, rows, seq)
    gm = prog.graph_module
    ours = apply_recompute(_fresh(gm), prog.layers, mode)
    systems = {"none": _fresh(gm), "torch.utils.checkpoint": _with_torch_checkpoint(apply_recompute(_fresh(gm), prog.layers, mode)),
               "fxpipe": ours}
    times: dict[str, list[float]] = {k: [] for k in systems}
    forward: list[float] = []
    for r in range(rounds + 3):
        for k, g in systems.items():
            t = step(g)
            if r >= 3:
                times[k].append(t)
        t = step(systems["none"], backward=False)
        if r >= 3:
            forward.append(t)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["forward"] = statistics.median(forward) * 1e3
    out["regions"] = len(regions_of(ours))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    keep_freed_blocks()  # as every runtime process does (base/cpu_memory.py)
    lines = [f"# bench_recompute — {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()} {os.cpu_count()} cpus, "
             f"torch {torch.__version__}, 1 thread, 8 x 32 tokens, {args.rounds} interleaved rounds, medians (ms)",
             "", "| model | mode | regions | none | ideal (none + forward) | torch.utils.checkpoint | fxpipe | "
             "checkpoint / none | fxpipe / none | fxpipe / checkpoint |", "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name in args.models:
        for mode in (RecomputeMode.FULL, RecomputeMode.SELECTIVE):
            m = measure(name, mode, args.rounds)
            ck, ours, none = m["torch.utils.checkpoint"], m["fxpipe"], m["none"]
            row = (f"| {name} | {mode.value} | {m['regions']} | {none:.2f} | {none + m['forward']:.2f} | {ck:.2f} | "
                   f"{ours:.2f} | {ck / none:.2f} | {ours / none:.2f} | {ours / ck:.2f} |")
            lines.append(row)
            print(row, flush=True)
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
