"""SC21 Figure 15: data vs tensor parallelism, 5.9B GPT on 64 GPUs.

    .venv/bin/python benchmarks/paper_fig15.py

Paper scale (run_figure_15.sh): 32 layers, h=3840, 32 heads, p=1, b=1, full recompute,
(t, d) with t·d = 64, t = 2 … 32, batch 32, 128, 512. The paper: throughput falls as t
grows (all-reduces every layer, across nodes beyond t=8, and smaller GEMMs).
No measured counterpart: at paper scale the comparison needs 64 GPUs; the runtime runs
tensor parallelism (tests/passes/tensor_parallel, `fxpipe run --tp`), but a 2-core CPU says nothing
about NVLink-bound all-reduces.
"""
from __future__ import annotations

from paper_common import common_args, figure, paper_config, paper_options, paper_shape, save_plot, write_table

from fxpipe.planner import Component, predict


def main() -> None:
    common_args(__doc__, measured=False)
    shape, opts = paper_shape("5.9B", 32, 3840, 32), paper_options()
    rows, curves = [], {}
    ts = (2, 4, 8, 16, 32)
    for B in (32, 128, 512):
        for t in ts:
            pred = predict(shape, paper_config(t=t, p=1, d=64 // t, B=B), opts)
            comm = 100 * pred.breakdown.get(Component.TP_COMM, 0) / pred.iteration_s
            rows.append([B, t, 64 // t, round(pred.tflops_per_gpu, 1), f"{comm:.0f}%", round(pred.memory_gb, 1)])
            curves.setdefault(B, []).append(pred.tflops_per_gpu)
    print(write_table("paper_fig15", ["batch", "t", "d", "TFLOP/s/GPU", "TP comm share", "GB/GPU"], rows,
                      "Predicted, A100 preset, p=1."))
    fig, ax = figure(5.5, 3.4)
    for B, ys in curves.items():
        ax.plot([f"({t},{64 // t})" for t in ts], ys, "o-", label=f"batch {B}")
    ax.set_xlabel("(tensor, data) parallel size")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("5.9B on 64 A100s (model)")
    ax.legend()
    print(save_plot(fig, "paper_fig15"))


if __name__ == "__main__":
    main()
