"""SC21 Figure 17: activation recomputation, 145B GPT, t=8, p=16.

    .venv/bin/python benchmarks/paper_fig17.py [--no-measured]

Paper scale (run_figure_17.sh): 80 layers, h=12288, 96 heads, b=1, 1F1B, batch 1…256,
with and without full recomputation: predicted sequences/s, and whether the layout fits
in 80 GB (the paper: without recomputation only small batches fit; with it, large
batches reach the higher throughput). Measured (fxpipe's recompute pass, applied to
every stage after the split): small GPT, 8 layers, p=2, b=2, m=4, none vs full —
step time, and the bytes one layer saves for backward (fxpipe.costs.saved_activations, in process) for
none / selective / full beside the planner's formula. ~1.5 min.
"""
from __future__ import annotations

from paper_common import (HEADS, HIDDEN, SEQ, VOCAB, Run, common_args, figure, measured_panel,
                          measured_section, paper_config, paper_options, save_plot, write_table)

from fxpipe.planner import predict, shape_from_registry


def activation_rows() -> list[list]:
    """Saved bytes per layer, measured by fxpipe.costs.saved_activations vs layer_activation_bytes (fp32 → ×2,
    fused CPU attention, dropout 0)."""
    import torch

    from fxpipe.compiler.capture import capture
    from fxpipe.costs.saved_activations import measure_saved
    from fxpipe.models.gpt import GPT, GPTConfig
    from fxpipe.compiler.driver import run_passes
    from fxpipe.passes.recompute import RecomputeMode, apply_recompute
    from fxpipe.planner.memory_model import layer_activation_bytes

    torch.manual_seed(0)
    b = 2
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=HEADS, n_embd=HIDDEN))
    tokens = torch.randint(0, VOCAB, (b, SEQ + 1))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    prog, _ = run_passes(capture(model, batch))
    rows = []
    for mode in RecomputeMode:
        gm = apply_recompute(prog.graph_module, prog.layers, mode)
        state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in prog.state.items()}
        args = [state[p.canonical] for p in prog.params] + list(batch)
        got = measure_saved(gm, args, prog.layers).by_layer[0]
        want = 2 * layer_activation_bytes(seq=SEQ, micro_batch=b, hidden=HIDDEN, heads=HEADS, recompute=mode,
                                          fused_attention=True)
        rows.append([mode.value, got / 1e6, round(want / 1e6, 3), round(100 * (want - got) / got, 1)])
    return rows


def main() -> None:
    args = common_args(__doc__)
    shape, opts = shape_from_registry("gpt-145b"), paper_options()
    rows, curves = [], {}
    batches = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    for rc in ("none", "full"):
        for B in batches:
            pred = predict(shape, paper_config(t=8, p=16, B=B, recompute=rc), opts)
            rows.append([rc, B, round(B / pred.iteration_s, 2), round(pred.tflops_per_gpu, 1),
                         round(pred.memory_gb, 1), pred.fits])
            curves.setdefault(rc, []).append((B, B / pred.iteration_s, pred.fits))
    print(write_table("paper_fig17", ["recompute", "batch", "sequences/s", "TFLOP/s/GPU", "GB/GPU",
                                      "fits 80 GB"], rows,
                      "Predicted, A100 preset, 128 GPUs (usable memory 90% of 80 GiB)."))
    fig, (ax, bx) = figure(9.0, 3.4, ncols=2)
    for rc, pts in curves.items():
        line, = ax.plot([b for b, _, _ in pts], [y for _, y, _ in pts], "o-", label=f"recompute {rc}")
        oom = [(b, y) for b, y, fits in pts if not fits]
        if oom:
            ax.plot(*zip(*oom), "x", color="red", ms=9)
    ax.plot([], [], "x", color="red", label="does not fit 80 GB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch")
    ax.set_ylabel("predicted sequences/s")
    ax.set_title("145B, t=8 p=16 (A100 model)")
    ax.legend(fontsize=7)
    if not args.no_measured:
        act = activation_rows()
        print(write_table("paper_fig17_activations", ["recompute", "measured MB/layer", "formula MB/layer",
                                                      "error %"], act,
                          f"One layer of fxpipe's GPT (h={HIDDEN}, {HEADS} heads, s={SEQ}, b=2, fp32, dropout 0, "
                          "CPU flash SDPA): bytes saved for backward, measured by fxpipe.costs.saved_activations, vs "
                          "layer_activation_bytes × 2 (fp32) with the 5as/h term dropped (fused attention). "
                          "The formula's 34 includes two 1-byte dropout masks, absent at dropout 0."))
        runs = [Run(label=f"recompute {rc}", layers=8, pp=2, micro_batch=2, microbatches=4, recompute=rc)
                for rc in ("none", "full")]
        measured_panel(bx, measured_section("paper_fig17_measured", runs, args.steps, not args.cached_profile,
                                            "No recomputation vs full, p=2, 8 layers:"))
    else:
        bx.axis("off")
    print(save_plot(fig, "paper_fig17"))


if __name__ == "__main__":
    main()
