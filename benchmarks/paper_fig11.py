"""SC21 Figure 11: weak scaling of pipeline parallelism.

    .venv/bin/python benchmarks/paper_fig11.py [--no-measured]

Paper scale (run_figure_11.sh): GPT with h=20480, 128 heads, 3·p layers, t=8, b=1,
full recompute, 1F1B, p = 1, 2, 4, 8 (8p GPUs), batch 8 and 128: predicted TFLOP/s
per GPU. Measured (this machine): fxpipe's small GPT with 4·p layers, p = 1, 2
processes, b=2, m = 2 and 8, and the prediction for each. ~2 min with measurements.
"""
from __future__ import annotations

from paper_common import (Run, common_args, figure, measured_panel, measured_section, paper_config,
                          paper_options, paper_shape, save_plot, write_table)

from fxpipe.planner import predict


def main() -> None:
    args = common_args(__doc__)
    opts = paper_options()
    rows, curves = [], {}
    for B in (8, 128):
        for p in (1, 2, 4, 8):
            pred = predict(paper_shape(f"{3 * p}L", 3 * p, 20480, 128), paper_config(t=8, p=p, B=B), opts)
            rows.append([B, p, 8 * p, 3 * p, round(pred.tflops_per_gpu, 1), f"{100 * pred.bubble_ratio:.1f}%",
                         round(pred.memory_gb, 1)])
            curves.setdefault(B, []).append((p, pred.tflops_per_gpu))
    print(write_table("paper_fig11", ["batch", "p", "GPUs", "layers", "TFLOP/s/GPU", "bubble", "GB/GPU"], rows,
                      "Predicted (A100 preset). The paper: the larger batch scales better, as the "
                      "bubble (p-1)/m is amortised over more microbatches."))
    fig, (ax, bx) = figure(9.0, 3.4, ncols=2)
    for B, pts in curves.items():
        ax.plot([8 * p for p, _ in pts], [y for _, y in pts], "o-", label=f"batch {B}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (t=8, p=GPUs/8)")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("paper scale (A100 model)")
    ax.legend()
    if not args.no_measured:
        runs = [Run(label=f"p={p} m={m}", layers=4 * p, pp=p, micro_batch=2, microbatches=m)
                for m in (2, 8) for p in (1, 2)]
        res = measured_section("paper_fig11_measured", runs, args.steps, not args.cached_profile,
                               "Weak scaling in p, 4 layers per pipeline rank:")
        measured_panel(bx, res)
    else:
        bx.axis("off")
    print(save_plot(fig, "paper_fig11"))


if __name__ == "__main__":
    main()
