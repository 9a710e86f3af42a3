"""Per-rank parameter memory of the vocabulary layers, with and without owned rows.

    .venv/bin/python benchmarks/vocab_rows_memory.py [--pp 2 4]

The model of ``bench_runtime.py`` (HF GPT-2, 8 layers, h=256, V=50257, tied embedding
and LM head), compiled in this process on the cost model (1F1B, m=8) with the
whole and the blockwise cross-entropy, and with vocabulary passes (the output layer's
block r on rank r, ``passes/vocab_head.py``). For every pipeline rank: the bytes of the
parameters whose rows ``passes/vocab_rows.py`` split, as held before the pass (the
whole tensor on every rank that reads it) and after (the rank's rows; the tied table's
embedding lookup done by the rows' owners, ``passes/outline_lookups.py``), against the
even share V·h/S (V·h: the bytes of every row-split tensor, the embedding's too when
untied). Shapes only: nothing is timed, so the numbers do not depend on the machine's
load. Writes nothing; prints one table per layout.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def measure(pp: int, split_loss: bool, vocab_passes: bool = False) -> list[str]:
    from bench_runtime import B_MICRO, M, workload
    from fxpipe.compiler.pipeline import compile_pipeline
    from fxpipe.ir.parallel_config import ParallelConfig

    model, batch, loss_fn = workload()
    config = ParallelConfig(pp=pp, microbatches=M, costs="model", split_loss=split_loss,
                            vocab_passes=vocab_passes).with_world(pp)
    c = compile_pipeline(model, tuple(t[:B_MICRO] for t in batch), config, loss_fn=loss_fn)
    plan, sched = c.plan, c.schedule
    how = "vocabulary passes" if vocab_passes else f"{'blockwise' if split_loss else 'whole'} cross-entropy"
    lines = [f"pp={pp}, {how}: "
             f"rows {{{', '.join(f'{n}: {r.ranks}' for n, r in plan.row_shards.items())}}}"]
    if not plan.row_shards:
        return lines + ["  no parameter read only as row slices on some rank: nothing split"]
    infos = {i.canonical: i for i in plan.program.params if i.canonical in plan.row_shards}
    whole = sum(i.numel * 4 for i in infos.values())  # fp32 bytes of the vocabulary layers
    even = whole / pp
    lookups = {lk.table: sched.stage_to_rank(lk.stage) for lk in plan.lookups}
    lines.append(f"  | pp rank | before (MiB) | after (MiB) | after / (V·h/S) |  (V·h: {whole / 2**20:.1f} MiB"
                 f"{', embedding looked up by the rows owners' if lookups else ''})")
    for p in range(pp):
        before = after = 0
        for name, info in infos.items():
            nbytes = info.numel * 4
            # Before the pass: the whole tensor on every rank a stage of which reads it
            # (the lookup's stage included: it read the whole table).
            if any(sched.stage_to_rank(s) == p for s in plan.param_stages.get(name, ())) or lookups.get(name) == p:
                before += nbytes
            if plan.row_shards[name].ranks[p]:
                after += nbytes * c.rank_specs(p)[name].local_shape[0] // info.shape[0]
        lines.append(f"  | {p} | {before / 2**20:.1f} | {after / 2**20:.1f} | {after / even:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    for pp in args.pp:
        for split_loss, vocab_passes in ((False, False), (True, False), (False, True)):
            print("\n".join(measure(pp, split_loss, vocab_passes)), flush=True)


if __name__ == "__main__":
    main()
