"""SC21 Figure 12: interleaved vs non-interleaved schedule, GPT-3 175B.

    .venv/bin/python benchmarks/paper_fig12.py [--no-measured]

Paper scale (run_figure_12.sh): 175B (96 layers, h=12288, 96 heads), t=8, p=12, b=1,
full recompute, batch 12…60; interleaved with 2 layers per chunk (v=4) vs 1F1B.
The paper: interleaving gains 10%+ at small batch, the gap closing as the batch grows.
Measured: small GPT, 8 layers, p=2, b=2, m = 2, 4, 8: 1F1B vs interleaved v=2. ~2 min.
"""
from __future__ import annotations

from paper_common import (Run, common_args, figure, measured_panel, measured_section, paper_config,
                          paper_options, save_plot, write_table)

from fxpipe.planner import predict, shape_from_registry


def main() -> None:
    args = common_args(__doc__)
    shape, opts = shape_from_registry("gpt3-175b"), paper_options()
    rows, one, inter = [], [], []
    batches = (12, 24, 36, 48, 60)
    for B in batches:
        a = predict(shape, paper_config(t=8, p=12, B=B), opts)
        b = predict(shape, paper_config(t=8, p=12, B=B, v=4), opts)
        one.append(a.tflops_per_gpu)
        inter.append(b.tflops_per_gpu)
        rows.append([B, round(a.tflops_per_gpu, 1), round(b.tflops_per_gpu, 1),
                     f"{100 * (b.tflops_per_gpu / a.tflops_per_gpu - 1):+.1f}%",
                     f"{100 * a.bubble_ratio:.0f}% / {100 * b.bubble_ratio:.0f}%",
                     f"{a.memory_gb:.0f} / {b.memory_gb:.0f}"])
    print(write_table("paper_fig12", ["batch", "1F1B TFLOP/s", "interleaved v=4", "gain", "bubble",
                                      "GB/GPU"], rows,
                      "Predicted, A100 preset, 96 GPUs. Paper: 10%+ gain at small batch, shrinking "
                      "with batch size (SC21 Fig. 12)."))
    fig, (ax, bx) = figure(9.0, 3.4, ncols=2)
    ax.plot(batches, one, "o-", label="1F1B")
    ax.plot(batches, inter, "s-", label="interleaved v=4")
    ax.set_xlabel("global batch")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("175B, t=8 p=12 (A100 model)")
    ax.legend()
    if not args.no_measured:
        runs = [Run(label=f"{s} m={m}", layers=8, pp=2, micro_batch=2, microbatches=m, schedule=s,
                    chunks=2 if s == "interleaved" else 1)
                for m in (2, 4, 8) for s in ("1f1b", "interleaved")]
        measured_panel(bx, measured_section("paper_fig12_measured", runs, args.steps, not args.cached_profile,
                                            "1F1B vs interleaved (v=2), p=2, 8 layers:"))
    else:
        bx.axis("off")
    print(save_plot(fig, "paper_fig12"))


if __name__ == "__main__":
    main()
