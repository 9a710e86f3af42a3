"""The seed's Megatron-LM-Benchmarks memory table: predicted vs measured peak memory.

    .venv/bin/python benchmarks/paper_memory.py

GPT-2 345M and BERT 345M (24 layers, h=1024, 16 heads; V=50257 / 30522 — BERT priced as
the same transformer with its vocabulary; bidirectional attention changes no formula),
layouts tp×pp = 2×2, 4×2 (BERT), 4×2, 8×1 (GPT), seq 512…2048, strategies baseline /
sequence parallel / selective / SP+selective / full recompute, 8 V100s. The benchmark
does not give its micro-batch: we assume Megatron's example scripts' (GPT b=4, BERT b=2,
global batch 16: examples/pretrain_{gpt,bert}_distributed_with_mp.sh), so d = 8/(t·p)
and m = 16/(b·d), 1F1B.
Predicted: the V100 preset, fp16 with 18 B/parameter of state, unfused attention.
Writes results/paper_memory.{md,csv,png} and paper_memory_ratios.md. Seconds.
"""
from __future__ import annotations

import statistics

from paper_common import figure, save_plot, write_table

from fxpipe.base.hardware import V100
from fxpipe.passes.recompute import RecomputeMode
from fxpipe.planner import LayerBalance, CandidateLayout, PlannerOptions, TransformerShape, predict

STRATEGIES = ("baseline", "SP", "selective", "SP+selective", "full")
# (model, tp, pp) -> seq -> ((time ms, peak MB) per strategy in STRATEGIES order), seed 002.
MEASURED = {
    ("BERT", 2, 2): {512: ((327, 2487), (388, 2359), (378, 2011), (437, 1868), (448, 1801)),
                     1024: ((330, 4491), (398, 4245), (382, 2607), (449, 2366), (450, 1840)),
                     1536: ((399, 7532), (427, 7151), (471, 3331), (489, 2969), (546, 2073)),
                     2048: ((567, 11490), (587, 10999), (655, 4110), (676, 3629), (765, 2318))},
    ("BERT", 4, 2): {512: ((537, 1376), (642, 1193), (635, 1139), (735, 954), (785, 936)),
                     1024: ((546, 2545), (646, 2161), (633, 1587), (734, 1225), (760, 985)),
                     1536: ((584, 4152), (660, 3608), (660, 2044), (749, 1505), (783, 1118)),
                     2048: ((743, 6267), (747, 5529), (758, 2567), (782, 1846), (805, 1302))},
    ("GPT-2", 4, 2): {512: ((288, 2113), (340, 1740), (336, 1631), (392, 1258), (412, 1107)),
                      1024: ((293, 4368), (343, 3631), (342, 2467), (398, 1747), (415, 1437)),
                      1536: ((386, 7619), (389, 6525), (440, 3421), (436, 2346), (522, 1791)),
                      2048: ((527, 11862), (520, 10382), (612, 4450), (604, 3005), (721, 2161))},
    ("GPT-2", 8, 1): {512: ((456, 1711), (558, 1280), (549, 1473), (635, 1042), (645, 933)),
                      1024: ((468, 3230), (550, 2367), (557, 2270), (644, 1406), (663, 1186)),
                      1536: ((469, 5204), (557, 3908), (559, 3034), (637, 1745), (661, 1446)),
                      2048: ((523, 7669), (558, 5949), (586, 3829), (646, 2109), (710, 1710))},
}
VOCAB = {"BERT": 30522, "GPT-2": 50257}
MICRO_BATCH = {"BERT": 2, "GPT-2": 4}
GLOBAL_BATCH, GPUS = 16, 8
MiB = 2 ** 20


def strategy(name: str) -> tuple[RecomputeMode, bool]:
    rc = {"baseline": "none", "SP": "none", "selective": "selective", "SP+selective": "selective",
          "full": "full"}[name]
    return RecomputeMode.parse(rc), name.startswith("SP")


def _order(values) -> tuple[int, ...]:
    return tuple(sorted(range(len(values)), key=lambda i: -values[i]))


def main() -> None:
    opts = PlannerOptions(hardware=V100, balance=LayerBalance.MEGATRON)
    rows, ratio_rows, panels = [], [], {}
    agree, pairs, mem_errors = 0, 0, []
    for (model, t, p), by_seq in MEASURED.items():
        d = GPUS // (t * p)
        for seq, measured in by_seq.items():
            shape = TransformerShape(name=model, layers=24, hidden=1024, heads=16, seq=seq,
                                     vocab=VOCAB[model], causal=model == "GPT-2")
            preds = []
            for name in STRATEGIES:
                rc, sp = strategy(name)
                b = MICRO_BATCH[model]
                cfg = CandidateLayout(tp=t, pp=p, dp=d, micro_batch=b,
                                     num_microbatches=GLOBAL_BATCH // (b * d), recompute=rc,
                                     sequence_parallel=sp)
                preds.append(predict(shape, cfg, opts))
            pm = [q.memory.total / MiB for q in preds]
            mm = [m for _, m in measured]
            pt = [q.iteration_s * 1e3 for q in preds]
            mt = [ms for ms, _ in measured]
            for name, q, (ms, mb), x in zip(STRATEGIES, preds, measured, pm):
                mem_errors.append(100 * (x - mb) / mb)
                rows.append([model, f"{t}x{p}", seq, name, mb, round(x), f"{100 * (x - mb) / mb:+.0f}%", ms,
                             round(q.iteration_s * 1e3)])
            # ordering: pairs of strategies ranked the same way by measured and predicted memory
            for i in range(5):
                for j in range(i + 1, 5):
                    if mm[i] != mm[j]:
                        pairs += 1
                        agree += (mm[i] > mm[j]) == (pm[i] > pm[j])
            ratio_rows.append([model, f"{t}x{p}", seq,
                               " / ".join(f"{mm[k] / mm[0]:.2f}" for k in range(1, 5)),
                               " / ".join(f"{pm[k] / pm[0]:.2f}" for k in range(1, 5)),
                               " / ".join(f"{mt[k] / mt[0]:.2f}" for k in range(1, 5)),
                               " / ".join(f"{pt[k] / pt[0]:.2f}" for k in range(1, 5)),
                               "yes" if _order(mm) == _order(pm) else "no"])
            panels.setdefault((model, t, p), []).append((seq, mm, pm))
    mae = statistics.mean(abs(e) for e in mem_errors)
    notes = (f"Peak memory per GPU in MiB (the benchmark's 'MB'); predicted = the rank with the most "
             f"memory: 18 B/parameter of state + activations of the in-flight microbatches "
             f"(Korthikanti et al.) + recomputation's working layer. Mean |error| {mae:.0f}%. "
             f"Time: predicted iteration ms on the V100 preset beside the measured (8 V100s, AWS).")
    print(write_table("paper_memory", ["model", "tp x pp", "seq", "strategy", "measured MB", "predicted MB",
                                       "error", "measured ms", "predicted ms"], rows, notes))
    print(write_table("paper_memory_ratios",
                      ["model", "tp x pp", "seq", "memory / baseline, measured (SP / sel / SP+sel / full)",
                       "predicted", "time / baseline, measured", "predicted", "same memory order"],
                      ratio_rows,
                      f"Pairs of strategies ordered alike by measured and predicted memory: {agree} of {pairs} "
                      f"({100 * agree / pairs:.0f}%)."))
    fig, axes = figure(9.0, 6.0, ncols=2, nrows=2)
    colors = dict(zip(STRATEGIES, ("C0", "C1", "C2", "C3", "C4")))
    for ax, ((model, t, p), pts) in zip(axes.flat, panels.items()):
        seqs = [s for s, _, _ in pts]
        for k, name in enumerate(STRATEGIES):
            ax.plot(seqs, [mm[k] for _, mm, _ in pts], "o-", color=colors[name], label=f"{name} measured")
            ax.plot(seqs, [pm[k] for _, _, pm in pts], "x--", color=colors[name], label=f"{name} predicted")
        ax.set_title(f"{model} 345M, tp={t} pp={p}", fontsize=9)
        ax.set_xlabel("sequence length", fontsize=8)
        ax.set_ylabel("peak MB per GPU", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=6, ncol=2)
    print(save_plot(fig, "paper_memory", dpi=70))
    print(f"memory: mean |error| {mae:.1f}%; order agreement {agree}/{pairs}")


if __name__ == "__main__":
    main()
