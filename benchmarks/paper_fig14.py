"""SC21 Figure 14: data vs pipeline parallelism, 5.9B GPT on 64 GPUs.

    .venv/bin/python benchmarks/paper_fig14.py [--no-measured]

Paper scale (run_figure_14.sh): 32 layers, h=3840, 32 heads, t=1, b=1, full recompute,
(p, d) with p·d = 64, p = 2 … 32, batch 32 and 512. The paper: throughput falls as p
grows (a larger bubble for the same batch); use model parallelism only to fit the model.
Measured: small GPT, 8 layers, 2 processes as (p=1, d=2) vs (p=2, d=1), batch 16. ~1.5 min.
"""
from __future__ import annotations

from paper_common import (Run, common_args, figure, measured_panel, measured_section, paper_config,
                          paper_options, paper_shape, save_plot, write_table)

from fxpipe.planner import predict


def main() -> None:
    args = common_args(__doc__)
    shape, opts = paper_shape("5.9B", 32, 3840, 32), paper_options()
    rows, curves = [], {}
    ps = (2, 4, 8, 16, 32)
    for B in (32, 512):
        for p in ps:
            pred = predict(shape, paper_config(t=1, p=p, d=64 // p, B=B), opts)
            rows.append([B, p, 64 // p, round(pred.tflops_per_gpu, 1), f"{100 * pred.bubble_ratio:.0f}%",
                         round(pred.memory_gb, 1), pred.fits])
            curves.setdefault(B, []).append(pred.tflops_per_gpu)
    print(write_table("paper_fig14", ["batch", "p", "d", "TFLOP/s/GPU", "bubble", "GB/GPU", "fits"], rows,
                      "Predicted, A100 preset, t=1."))
    fig, (ax, bx) = figure(9.0, 3.4, ncols=2)
    for B, ys in curves.items():
        ax.plot([f"({p},{64 // p})" for p in ps], ys, "o-", label=f"batch {B}")
    ax.set_xlabel("(pipeline, data) parallel size")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("5.9B on 64 A100s (model)")
    ax.legend()
    if not args.no_measured:
        runs = [Run(label="p=1 d=2", layers=8, pp=1, dp=2, micro_batch=2, microbatches=4),
                Run(label="p=2 d=1", layers=8, pp=2, dp=1, micro_batch=2, microbatches=8)]
        measured_panel(bx, measured_section("paper_fig14_measured", runs, args.steps, not args.cached_profile,
                                            "Data vs pipeline parallel on 2 processes, batch 16, 8 layers:"))
    else:
        bx.axis("off")
    print(save_plot(fig, "paper_fig14"))


if __name__ == "__main__":
    main()
