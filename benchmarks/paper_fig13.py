"""SC21 Figure 13: tensor vs pipeline parallelism, 162B GPT on 64 GPUs.

    .venv/bin/python benchmarks/paper_fig13.py

Paper scale (run_figure_13.sh): 32 layers, h=20480, 128 heads, b=1, full recompute,
1F1B, (t, p) = (32, 2) … (2, 32), batch 32 and 128. The paper's takeaway: tensor
parallelism up to the GPUs of a node (t=8), pipeline parallelism across nodes.
No measured counterpart: at paper scale the comparison needs 64 GPUs; the runtime runs
tensor parallelism (tests/passes/tensor_parallel, `fxpipe run --tp`), but a 2-core CPU says nothing
about NVLink-bound all-reduces.
"""
from __future__ import annotations

from paper_common import common_args, figure, paper_config, paper_options, paper_shape, save_plot, write_table

from fxpipe.planner import Component, predict


def main() -> None:
    common_args(__doc__, measured=False)
    shape, opts = paper_shape("162B", 32, 20480, 128), paper_options()
    pairs = ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2))
    rows, curves = [], {}
    for B in (32, 128):
        for t, p in pairs:
            pred = predict(shape, paper_config(t=t, p=p, B=B), opts)
            share = {c: 100 * pred.breakdown.get(c, 0) / pred.iteration_s for c in
                     (Component.TP_COMM, Component.BUBBLE)}
            rows.append([B, t, p, round(pred.tflops_per_gpu, 1), f"{share[Component.TP_COMM]:.0f}%",
                         f"{share[Component.BUBBLE]:.0f}%", round(pred.memory_gb, 1), pred.fits])
            curves.setdefault(B, []).append(pred.tflops_per_gpu)
    print(write_table("paper_fig13", ["batch", "t", "p", "TFLOP/s/GPU", "TP comm share", "bubble share",
                                      "GB/GPU", "fits 80 GB"], rows,
                      "Predicted, A100 preset. t > 8 crosses nodes (InfiniBand all-reduces)."))
    fig, ax = figure(5.5, 3.4)
    labels = [f"({t},{p})" for t, p in pairs]
    for B, ys in curves.items():
        ax.plot(labels, ys, "o-", label=f"batch {B}")
    ax.set_xlabel("(tensor, pipeline) parallel size")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("162B on 64 A100s (model)")
    ax.legend()
    print(save_plot(fig, "paper_fig13"))


if __name__ == "__main__":
    main()
