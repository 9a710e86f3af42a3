"""Published measured runs with their layouts pinned: `fxpipe plan`'s price against the
Megatron-LM README's H100 table and Korthikanti et al.'s Table 5 (A100), and the search's
own choice beside each (``fxpipe/planner/published.py`` holds the rows and their settings).

    .venv/bin/python benchmarks/published_runs.py     # or via benchmarks/paper_table1.py

Each row's model is a GPT of the row's shape built on the meta device and captured with
two layers (the graph repeats; the count is extrapolated, fxpipe/planner/captured.py), as
`fxpipe plan` does for any model: the price is the captured graph's own matrices. The
published layout is pinned (t, p, d, B, and b, v, recompute, SP where published); what
is not published is searched, on the schedules the run's framework offers. 'search' is
the planner's own choice for the same GPUs and batch with nothing pinned. No constant
is fitted to these rows: the presets' sources are in fxpipe/base/presets/.
Writes results/published_runs.{md,csv}; a few minutes (the captures).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

from paper_common import write_table

from fxpipe.compiler.pipeline import capture_for
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.gpt import GPT, GPTConfig
from fxpipe.models.workload import _token_batch
from fxpipe.planner import plan
from fxpipe.planner.captured import CAPTURE_LAYERS, shape_of
from fxpipe.planner.published import PUBLISHED, PublishedRun

import torch


def captured(run: PublishedRun):
    """The row's GPT on meta, ``CAPTURE_LAYERS`` layers captured, its shape read off the graph."""
    cfg = GPTConfig(vocab_size=run.vocab, block_size=run.seq, n_layer=CAPTURE_LAYERS, n_head=run.heads,
                    n_embd=run.hidden, dropout=0.1 if run.dropout else 0.0)
    with torch.device("meta"):
        model = GPT(cfg)
    x = _token_batch(1, run.seq + 1, run.vocab, "meta", 0)
    program = capture_for(model, (x[:, :-1].contiguous(), x[:, 1:].contiguous()), ParallelConfig(), None)
    shape = shape_of(program, f"gpt-{run.label}", layers=run.layers).shape
    # the run's attention kernel: the 2022 rows ran Megatron's unfused softmax
    return replace(shape, fused_attention=run.fused_attention)


def main() -> list[list]:
    rows, errors, within = [], [], 0
    for run in PUBLISHED:
        start = time.perf_counter()
        shape = captured(run)
        took = time.perf_counter() - start
        pinned = plan(shape, run.gpus, run.global_batch, run.options(pinned=True), top=1).predictions[0]
        own = plan(shape, run.gpus, run.global_batch, run.options(pinned=False), top=1).predictions[0]
        err = pinned.iteration_s / run.iteration_s - 1
        errors.append(err)
        within += abs(err) <= 0.15
        rows.append([run.source.split(",")[0], run.label, run.tp, run.pp, run.dp, run.global_batch,
                     round(run.iteration_s, 2), round(pinned.iteration_s, 2), f"{100 * err:+.1f}%",
                     pinned.config.label(), round(own.iteration_s, 2), own.config.label(),
                     "yes" if own.iteration_s <= pinned.iteration_s * (1 + 1e-9) else "NO", f"{took:.0f}"])
    notes = (f"Within 15% of the published iteration: **{within} of {len(PUBLISHED)}** rows "
             f"({100 * within / len(PUBLISHED):.0f}%); median |error| "
             f"{100 * statistics.median(abs(e) for e in errors):.1f}%, signed mean "
             f"{100 * statistics.mean(errors):+.1f}%. Megatron-LM rows: iteration = 72·B·s·l·h²(1 + s/6h + V/12lh) / "
             "(TFLOP/s × GPUs); H100 preset, flash attention, distributed optimizer, DP and TP overlap (the "
             "runs' settings). Korthikanti rows: A100 preset, unfused attention, dropout 0.1, d = 1. "
             "'search ≤ pinned': the planner's own choice is predicted no slower than the published layout.")
    header = ["source", "row", "t", "p", "d", "B", "published s", "predicted s", "error", "pinned layout (rest searched)",
              "search s", "search's choice", "search ≤ pinned", "capture s"]
    print(write_table("published_runs", header, rows, notes))
    return rows


if __name__ == "__main__":
    main()
