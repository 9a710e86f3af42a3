"""SC21 Figure 16: micro-batch size, 91B GPT, t=8, p=8.

    .venv/bin/python benchmarks/paper_fig16.py [--no-measured]

Paper scale (run_figure_16.sh): 32 layers, h=15360, 128 heads, full recompute, 1F1B,
b = 1, 2, 4, 8, batch 128 and 512. The paper: the best b depends on the model — larger
b runs the GEMMs better but leaves fewer microbatches (m = B/b) to fill the pipeline.
Measured: small GPT, 8 layers, p=2, batch 32, b = 1, 2, 4, 8. ~2 min.
"""
from __future__ import annotations

from paper_common import (Run, common_args, figure, measured_panel, measured_section, paper_config,
                          paper_options, paper_shape, save_plot, write_table)

from fxpipe.planner import predict


def main() -> None:
    args = common_args(__doc__)
    shape, opts = paper_shape("91B", 32, 15360, 128), paper_options()
    rows, curves = [], {}
    bs = (1, 2, 4, 8)
    for B in (128, 512):
        for b in bs:
            pred = predict(shape, paper_config(t=8, p=8, b=b, B=B), opts)
            rows.append([B, b, B // b, round(pred.tflops_per_gpu, 1), f"{100 * pred.bubble_ratio:.0f}%",
                         round(pred.memory_gb, 1), pred.fits])
            curves.setdefault(B, []).append(pred.tflops_per_gpu)
    print(write_table("paper_fig16", ["batch", "b", "m", "TFLOP/s/GPU", "bubble", "GB/GPU", "fits"], rows,
                      "Predicted, A100 preset, 64 GPUs."))
    fig, (ax, bx) = figure(9.0, 3.4, ncols=2)
    for B, ys in curves.items():
        ax.plot(bs, ys, "o-", label=f"batch {B}")
    ax.set_xlabel("micro-batch size b")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("91B, t=8 p=8 (A100 model)")
    ax.legend()
    if not args.no_measured:
        runs = [Run(label=f"b={b} m={32 // b}", layers=8, pp=2, micro_batch=b, microbatches=32 // b)
                for b in bs]
        measured_panel(bx, measured_section("paper_fig16_measured", runs, args.steps, not args.cached_profile,
                                            "Micro-batch size at batch 32, p=2, 8 layers:"))
    else:
        bx.axis("off")
    print(save_plot(fig, "paper_fig16"))


if __name__ == "__main__":
    main()
