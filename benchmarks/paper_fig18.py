"""SC21 Figure 18: the scatter-gather optimisation, GPT-3 175B, interleaved.

    .venv/bin/python benchmarks/paper_fig18.py

Paper scale (run_figure_18.sh): 175B, t=8, p=12, v=4 (2 layers per chunk), b=1, full
recompute, batch 12…60, with and without scatter-gather (SC21 §4.1: each TP rank sends
bsh/t across nodes and the receiver all-gathers over NVLink). The paper: up to 11%.
No measured counterpart: it needs tensor parallelism.
"""
from __future__ import annotations

from dataclasses import replace

from paper_common import common_args, figure, paper_config, paper_options, save_plot, write_table

from fxpipe.planner import Component, predict, shape_from_registry


def main() -> None:
    common_args(__doc__, measured=False)
    shape, opts = shape_from_registry("gpt3-175b"), paper_options()
    rows, on, off = [], [], []
    batches = (12, 24, 36, 48, 60)
    for B in batches:
        cfg = paper_config(t=8, p=12, B=B, v=4)
        a = predict(shape, cfg, opts)
        b = predict(shape, cfg, replace(opts, scatter_gather=False))
        on.append(a.tflops_per_gpu)
        off.append(b.tflops_per_gpu)
        rows.append([B, round(b.tflops_per_gpu, 1), round(a.tflops_per_gpu, 1),
                     f"{100 * (a.tflops_per_gpu / b.tflops_per_gpu - 1):+.1f}%",
                     f"{100 * b.breakdown.get(Component.P2P, 0) / b.iteration_s:.1f}% / "
                     f"{100 * a.breakdown.get(Component.P2P, 0) / a.iteration_s:.1f}%"])
    print(write_table("paper_fig18", ["batch", "without s/g TFLOP/s", "with s/g", "gain", "p2p share"], rows,
                      "Predicted, A100 preset, 96 GPUs, interleaved v=4. Paper: up to 11% (SC21 Fig. 18)."))
    fig, ax = figure(5.5, 3.4)
    ax.plot(batches, off, "o-", label="without scatter-gather")
    ax.plot(batches, on, "s-", label="with scatter-gather")
    ax.set_xlabel("global batch")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("175B, t=8 p=12 v=4 (A100 model)")
    ax.legend()
    print(save_plot(fig, "paper_fig18"))


if __name__ == "__main__":
    main()
