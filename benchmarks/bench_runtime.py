"""End to end, as users would run it: fxpipe vs torch.distributed.pipelining vs one process.

    .venv/bin/python benchmarks/bench_runtime.py [--steps 10] [--pp 2] [--vocab-passes [--unit-placement]]

HF GPT-2 config (8 layers, h=256, 4 heads, s=128, V=50257), m=8 microbatches of 2
sequences, one thread per process, gloo. Side by side in one run, same model,
batch and threads:

- **fxpipe**: ``fxpipe.parallelize(model, pp=P, microbatches=8, ...)`` with its
  defaults (ILP partition on costs measured on the ranks, 1F1B);
- **torch.distributed.pipelining** set up as its documentation shows: ``pipeline()``
  with a ``SplitPoint`` at the middle layer (an even layer split), ``build_stage``,
  ``Schedule1F1B``. Where the traced split sends a tensor that cannot carry a gradient
  (transformers 5 builds GPT-2's causal mask as a bool tensor, and PipelineStage
  makes every received tensor require grad), the same even layer split is cut by
  fxpipe's ``uniform`` partition and its stage graphs run by ``PipelineStage`` +
  ``Schedule1F1B`` instead — the result file says which ran;
- **fxpipe on that even layer split** (``partition="uniform"``): what the partition
  gains, apart from how the two runtimes differ;
- **one process** with gradient accumulation over the same 8 microbatches;
- with ``--vocab-passes --unit-placement``: **fxpipe with the vocabulary passes at unit
  times** as well (the same layout, its executor walking ``add_vocab_passes`` with unit
  times, the schedule before ``compiler/vocab_placement.py`` placed the passes on the stages'
  costs), so the two placements are timed in the same rounds.

Rounds: each times every contender once, back to back (also P independent copies of
the one-process job at once: the machine's own ceiling for a P-way split while P is at
most the cores; with more processes than cores the copies time-share the cores and the
figure is reported, not used as a bound), so a shared VM's drift hits all alike. Also
reported: the busy time summed over all stages against the one-process step (the work
the split adds). Prints the median step times, the three ratios the balance issue sets targets for
(stage imbalance <= 1.10, speed-up over one process >= 1.70x at pp=2, fxpipe <= 0.60x
the even-split pipeline), fxpipe's per-stage predicted vs measured times, and writes
benchmarks/results/runtime_pp{P}.md (``runtime_pp{P}_vocab.md`` with --vocab-passes,
``runtime_pp{P}_vocab_placement[_SCHEDULE].md`` with --unit-placement too). Medians over --steps rounds after one warm-up.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.runtime.local_world import run_local_world

M, B_MICRO, SEQ, LAYERS, HIDDEN, HEADS, VOCAB = 8, 2, 128, 8, 256, 4, 50257
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def workload():
    from fxpipe.models.losses import causal_lm_loss
    from fxpipe.models.hf import _gpt2

    torch.manual_seed(0)
    model = _gpt2(layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ)
    ids = torch.randint(0, VOCAB, (M * B_MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone()), causal_lm_loss


class _StageModule(nn.Module):
    """One stage GraphModule of an even-layer fxpipe plan as the nn.Module that
    torch.distributed.pipelining's PipelineStage drives (the fallback below). Batch
    inputs a later stage reads (labels) come from ``self.microbatches`` in microbatch
    order, as 1F1B runs each stage's forwards in that order."""

    def __init__(self, plan, stage, state, model):
        super().__init__()
        self.plan, self.stage = plan, stage
        self.names = plan.stage_params(stage.index)
        self.params = nn.ParameterList([nn.Parameter(state[n].detach().clone()) for n in self.names])
        # An embedding fxpipe has its rows' owners look up (runtime/lookup_exchange.py) is
        # looked up here in a whole copy of the table, as pipelining's stage would hold it.
        self.lookups = [lk for lk in plan.lookups if lk.stage == stage.index]
        self.tables = nn.ParameterList([nn.Parameter(model.get_parameter(lk.table).detach().clone())
                                        for lk in self.lookups])
        self.microbatches: list = []
        self.calls = 0

    def forward(self, *received):
        state = dict(zip(self.names, self.params))
        batch = self.microbatches[self.calls % len(self.microbatches)]
        self.calls += 1
        inputs = dict(zip(self.stage.inputs, received))
        for lk, table in zip(self.lookups, self.tables):
            inputs[lk.name] = torch.nn.functional.embedding(lk.ids(batch[lk.batch_input]), table)
        out = self.stage.call(state, self.plan.canonical, batch, inputs)
        if self.stage.is_last:  # pipelining concatenates last-stage outputs: no 0-d tensors
            return out[-1].reshape(1)
        return out[0] if len(out) == 1 else out


def _non_float_crossings(pipe) -> list[str]:
    """Values a traced pipeline sends between stages that cannot carry a gradient:
    PipelineStage makes every received tensor require grad, which fails for them."""
    bad = []
    for k, (_, mod) in enumerate(pipe.split_gm.named_children()):
        for n in mod.graph.nodes:
            val = n.meta.get("val")
            if k and n.op == "placeholder" and isinstance(val, torch.Tensor) and not val.dtype.is_floating_point:
                bad.append(f"{n.name} ({val.dtype}) into stage {k}")
    return bad


class Logits(nn.Module):
    """What a user hands to ``pipeline()``: the HF model returning its logits tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def placement(pm, unit_model=None) -> dict:
    """The vocabulary passes' placement of ``pm`` against unit times: whether the two
    schedules differ and their simulated steps on the compiled stage and head times
    (``compiler/vocab_placement.py``). ``unit_model``: a second model whose executor is made to
    walk the unit placement (the schedule before placement on costs), to time both."""
    from fxpipe.schedules import lower, simulate
    from fxpipe.compiler.vocab_placement import vocab_timing

    unit = lower(pm.config.schedule_ir())
    if unit_model is not None:  # the same actions in the unit order: only the placement differs
        unit_model.schedule = unit_model.executor.schedule = unit
        unit_model.executor.actions = unit.actions[unit_model.groups.pp_rank]
    timing = vocab_timing(pm.plan, pm.config, pm.plan.program.partition_config)
    if timing is None:
        return dict(differ=pm.schedule.actions != unit.actions, placed_ms=None, unit_ms=None)
    span = lambda s: 1e3 * simulate(s, timing.durations, p2p_latency=timing.p2p_latency,  # noqa: E731
                                    collective_latency=timing.collective_latency).makespan
    return dict(differ=pm.schedule.actions != unit.actions, placed_ms=span(pm.schedule), unit_ms=span(unit))


def worker(rank: int, world: int, steps: int, out: str, schedule: str | None,
           vocab_passes: bool = False, unit_placement: bool = False) -> None:
    import fxpipe
    from fxpipe.runtime.balance import BalanceMeter
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    model, batch, loss_fn = workload()
    t = time.perf_counter()
    pm = fxpipe.parallelize(model, pp=world, microbatches=M, example_inputs=batch, loss_fn=loss_fn,
                            vocab_passes=vocab_passes, **({"schedule": schedule} if schedule else {}))
    setup = time.perf_counter() - t
    meter = BalanceMeter()

    # torch.distributed.pipelining as documented: trace, split at the middle layer(s).
    from torch.distributed.pipelining import PipelineStage

    model2, _, _ = workload()
    cuts = {f"model.transformer.h.{LAYERS * k // world}": SplitPoint.BEGINNING for k in range(1, world)}
    pipe = pipeline(Logits(model2), mb_args=(batch[0][:B_MICRO],), split_spec=cuts)
    blocked = _non_float_crossings(pipe)

    def lm_loss(logits, labels):
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           labels[:, 1:].reshape(-1))

    if not blocked:
        how = "pipeline() + SplitPoint at the middle layer"
        sched = Schedule1F1B(pipe.build_stage(rank, torch.device("cpu")), n_microbatches=M, loss_fn=lm_loss)

        def pippy_step():
            if rank == 0:
                sched.step(batch[0])
            elif rank == world - 1:
                sched.step(target=batch[1])
            else:
                sched.step()
    else:
        # The same even layer split, cut by fxpipe's uniform (Megatron-style) partition,
        # each stage's graph run by PipelineStage + Schedule1F1B.
        how = ("PipelineStage + Schedule1F1B on the even layer split (pipeline() traced, but "
               f"{', '.join(blocked)} crosses the split and PipelineStage requires grad on received tensors)")
        model3, _, _ = workload()
        even = fxpipe.parallelize(model3, pp=world, microbatches=M, example_inputs=batch, loss_fn=loss_fn,
                                  partition="uniform", costs="model")
        module = _StageModule(even.plan, even.plan.stages[rank], even.state, model3)
        sched = Schedule1F1B(PipelineStage(module, rank, world, torch.device("cpu")), n_microbatches=M,
                             loss_fn=lambda loss, target: loss.sum())
        micro = [tuple(t.chunk(M)[i] for t in batch) for i in range(M)]
        dummy = torch.zeros(M * B_MICRO)

        def pippy_step():
            module.microbatches, module.calls = micro, 0
            if rank == 0:
                sched.step(batch[0])
            elif rank == world - 1:
                sched.step(target=dummy)
            else:
                sched.step()

    single_step = single_process()
    # fxpipe's own runtime on the same even layer split: separates what the partition
    # gains from what the runtimes differ by.
    model4, _, _ = workload()
    fx_even = fxpipe.parallelize(model4, pp=world, microbatches=M, example_inputs=batch, loss_fn=loss_fn,
                                 partition="uniform", costs="model")
    even_meter = BalanceMeter()
    fx_unit, placed = None, None
    if vocab_passes:
        if unit_placement:  # the same layout, its vocabulary passes at unit times
            model5, _, _ = workload()
            fx_unit = fxpipe.parallelize(model5, pp=world, microbatches=M, example_inputs=batch, loss_fn=loss_fn,
                                         vocab_passes=True, **({"schedule": schedule} if schedule else {}))
        placed = placement(pm, fx_unit)
    # One round times each contender once, back to back, so a shared VM's drift (its
    # speed moved by 20-30% within minutes while these were taken) hits all of them
    # alike; the ratios are medians over rounds. "alone": rank 0 runs the one-process
    # job while the others wait; "shared": every rank runs its own copy at once.
    contenders = {
        "fx": (lambda: pm.train_step(batch), lambda: meter.add(pm.last_stats.events)),
        "pippy": (pippy_step, None),
        "fx_even": (lambda: fx_even.train_step(batch), lambda: even_meter.add(fx_even.last_stats.events)),
        "alone": (lambda: single_step() if rank == 0 else None, None),
        "shared": (single_step, None),
    }
    if fx_unit is not None:
        contenders["fx_unit"] = (lambda: fx_unit.train_step(batch), None)
    for fn, _ in contenders.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(steps):
        for key, (fn, each) in contenders.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier()  # a step ends when its slowest rank does
            times[key].append(time.perf_counter() - t)
            if each is not None:
                each()
    torch.save(dict(times=times, setup=setup, balance=meter.summary(), how=how,
                    even_balance=even_meter.summary(), even_partition=fx_even.partition if rank == 0 else None,
                    partition=pm.partition if rank == 0 else None, placed=placed),
               os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def single_process():
    """One step of the one-process job: gradient accumulation over the M microbatches."""
    model, batch, loss_fn = workload()
    micro = [tuple(t.chunk(M)[i] for t in batch) for i in range(M)]

    def step():
        for ids, labels in micro:
            (loss_fn(model(ids), labels) / M).backward()
        model.zero_grad(set_to_none=True)

    return step


def write_result(name: str, text: str) -> None:
    """Print ``text`` and write it to benchmarks/results/``name``."""
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name), "w") as f:
        f.write(text)


def placement_lines(placed: dict | None, times, med, ratio) -> list[str]:
    """The vocabulary passes' placement on costs against unit times (``placement``)."""
    if placed is None:
        return []
    if placed["placed_ms"] is None:
        lines = ["- vocabulary passes placed at unit times (the partition balanced no times)"]
    else:
        same = "differs from" if placed["differ"] else "is the same action order as"
        lines = [f"- vocabulary passes placed on the stages' costs (offset 0): the schedule {same} the unit "
                 f"placement; simulated step on the compiled times {placed['placed_ms']:.1f} ms placed, "
                 f"{placed['unit_ms']:.1f} ms at unit times"]
    if "fx_unit" in times:
        lines.append(f"- measured, same rounds: placed on costs {med['fx'] * 1e3:.1f} ms, at unit times "
                     f"{med['fx_unit'] * 1e3:.1f} ms; placed / unit step time: **{ratio('fx', 'fx_unit'):.3f}**")
    return lines


def main() -> None:
    from fxpipe.runtime.balance import balance, balance_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--schedule", default=None, help="fxpipe's schedule (default: parallelize's default)")
    ap.add_argument("--vocab-passes", action="store_true",
                    help="fxpipe's row: the output layer as vocabulary passes on every rank")
    ap.add_argument("--unit-placement", action="store_true",
                    help="with --vocab-passes: also time the same layout with the passes placed at unit times "
                         "(what the runtime ran before placing them on the stages' costs), in the same rounds")
    args = ap.parse_args()
    if args.unit_placement and not args.vocab_passes:
        ap.error("--unit-placement compares placements of the vocabulary passes: add --vocab-passes")
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
               f"{args.pp} processes x 1 thread, gloo")
    print(f"machine: {machine}")
    with tempfile.TemporaryDirectory() as out:
        run_local_world(args.pp, worker, args.steps, out, args.schedule, args.vocab_passes, args.unit_placement,
                        timeout=timedelta(seconds=300), threads=1)
        res = [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(args.pp)]
    times = res[0]["times"]  # barrier-bounded: every rank measured the same spans
    med = {k: statistics.median(v) for k, v in times.items()}
    fx, pippy, single, shared = med["fx"], med["pippy"], med["alone"], med["shared"]
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
    rows, imbalance = balance(res[0]["partition"], [r["balance"] for r in res])
    even_rows, even_imbalance = balance(res[0]["even_partition"], [r["even_balance"] for r in res])
    ideal = args.pp * M / (M + args.pp - 1)
    schedule_label = (f"defaults: measured costs, ILP, {args.schedule or '1f1b'}"
                      + (", vocabulary passes" if args.vocab_passes else ""))
    # Name the torch contender that actually ran: pipeline()'s own split, or (where its traced
    # split cannot run) PipelineStage + Schedule1F1B over fxpipe's uniform stage graphs.
    pippy_label = ("torch.distributed.pipelining, pipeline() even layer split, Schedule1F1B"
                   if res[0]["how"].startswith("pipeline()") else
                   "torch.distributed.pipelining PipelineStage + Schedule1F1B on fxpipe's even layer split")
    sp_fx, sp_pippy, slow = ratio("alone", "fx"), ratio("alone", "pippy"), ratio("shared", "alone")
    # What this machine allows any P-stage pipeline of this job: P processes each doing
    # 1/P of the work, each as fast as one of P independent copies of the one-process
    # job side by side; 1F1B adds its fill/drain factor m / (m + p - 1).
    ceiling = ideal / slow
    cores = os.cpu_count() or 1
    # Busy time summed over every stage (each stage's compute actions per step) against the
    # one-process step: what splitting the model adds in work, apart from waiting.
    summed_busy = sum(r.busy_ms for r in rows)
    if args.pp <= cores:
        ceiling_line = (
            f"- machine ceiling: side by side, each copy of the one-process job runs {slow:.3f}x its time "
            f"alone, so no {args.pp}-stage 1F1B pipeline here beats **{ceiling:.3f}x** ({ideal:.2f}x / {slow:.3f}); "
            f"fxpipe reaches **{sp_fx / ceiling:.3f}** of it. No {args.pp}-stage pipeline of any schedule "
            f"beats {args.pp / slow:.2f}x, so fxpipe / even-split pipelining cannot go below "
            f"{sp_pippy * slow / args.pp:.3f} while the even split runs at {sp_pippy:.3f}x")
    else:
        # With more processes than cores, P copies side by side time-share the cores: their
        # slow-down measures the sharing, not what a pipeline (whose stages wait on each
        # other and so leave cores idle) can reach. Reported as what it is.
        ceiling_line = (
            f"- no machine ceiling: {args.pp} processes on {cores} cores time-share them, so {args.pp} "
            f"side-by-side copies of the one-process job (each {slow:.3f}x its time alone) bound nothing "
            f"a pipeline can reach (compare the speed-ups and the summed busy time instead)")
    lines = [
        f"# End to end: fxpipe vs torch.distributed.pipelining vs one process (pp={args.pp})", "",
        f"Machine: {machine}. HF GPT-2 {LAYERS} layers, h={HIDDEN}, s={SEQ}, V={VOCAB}; "
        f"m={M} microbatches of {B_MICRO}; {args.steps} rounds after 1 warm-up, each round timing "
        f"every row once back to back; medians (ratios: medians of per-round ratios).", "",
        "| | median step ms |", "|---|---|",
        f"| fxpipe.parallelize ({schedule_label}) | {fx * 1e3:.1f} |",
        f"| {pippy_label} | {pippy * 1e3:.1f} |",
        f"| fxpipe.parallelize on that even layer split (partition='uniform'), 1F1B | {med['fx_even'] * 1e3:.1f} |",
        f"| one process, gradient accumulation (the others idle) | {single * 1e3:.1f} |",
        f"| {args.pp} independent copies of the one process at once | {shared * 1e3:.1f} |", "",
        f"- measured stage imbalance (max/mean busy time): **{imbalance:.3f}** (target <= 1.10)",
        f"- speed-up over one process: **{sp_fx:.3f}x** (ideal 1F1B {ideal:.2f}x; target >= 1.70x at pp=2)",
        f"- fxpipe / even-split pipelining step time: **{ratio('fx', 'pippy'):.3f}** (target <= 0.60)",
        f"- torch.distributed.pipelining speed-up over one process: {sp_pippy:.3f}x; fxpipe on the same "
        f"even split: {ratio('alone', 'fx_even'):.3f}x (measured imbalance {even_imbalance:.3f})",
        ceiling_line,
        f"- busy time summed over the {args.pp} stages: {summed_busy:.0f} ms per step, "
        f"**{summed_busy / (single * 1e3):.3f}x** the one-process step (the work the split adds; "
        f"target <= 1.08)",
        f"- fxpipe setup (capture, cost measurement, partition, split): {max(r['setup'] for r in res):.1f} s",
        f"- torch.distributed.pipelining set up as: {res[0]['how']}",
        *placement_lines(res[0].get("placed"), times, med, ratio),
        "", "```", balance_table(rows, imbalance), "```", "",
        "The even layer split, run by fxpipe:", "", "```", balance_table(even_rows, even_imbalance), "```", "",
        "Per round, ms: " + "; ".join(f"{k} " + " ".join(f"{t * 1e3:.0f}" for t in v) for k, v in times.items()), ""]
    suffix = ("_vocab" if args.vocab_passes else "") + (
        ("_placement" + (f"_{args.schedule}" if args.schedule else "")) if args.unit_placement else "")
    write_result(f"runtime_pp{args.pp}{suffix}.md", "\n".join(lines))


if __name__ == "__main__":
    main()
