"""Training cases run inside spawned gloo workers (importable by the children)."""
from __future__ import annotations

import dataclasses
import traceback

import torch

from fxpipe.models import build_workload

STEPS = 3
LR = 1e-3  # AdamW's, in the reference and the parallel runs
BATCH, SEQ, LAYERS, MICROBATCHES = 8, 16, 4, 4


def workload(name: str):
    return build_workload(name, batch=BATCH, seq=SEQ, layers=LAYERS, seed=0)


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process AdamW: per-step losses, final parameters, first-step gradients."""
    w = workload(name)
    opt = torch.optim.AdamW(w.model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        if w.loss_fn is not None:
            loss = w.loss_fn(w.model(*w.example_inputs[:-1]), w.example_inputs[-1])
        else:
            loss = w.model(*w.example_inputs)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in w.model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in w.model.named_parameters()}, grads


def train(pm, w, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """``steps`` of AdamW on ``pm``: per-step losses, the first step's full gradients
    (every rank's share gathered: TP shards, and the rows of a split vocabulary layer)
    and its global gradient norm as clipping computes it (each parameter counted once)."""
    from fxpipe.runtime.grad_norm import global_grad_norm

    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(steps):
        losses.append(pm.train_step(w.example_inputs))
        if step == 0:
            grads = pm.gather_full({n: t.grad.clone() for n, t in pm.named_parameters()})
            norm = global_grad_norm(pm)
        opt.step()
    return losses, grads, norm


def train_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case: dict(model, pp, schedule, chunks). Returns losses, parameters, stats."""
    from fxpipe.parallel import parallelize
    from fxpipe.schedules.simulate import simulate
    from tests.runtime._reuse_capture import captures_reused

    out = []
    with captures_reused():
        for case in cases:
            try:
                out.append(_train_case(parallelize, simulate, rank, case))
            except Exception:
                # A case that fails on every rank before its first collective (a compile
                # error) is that case's failure, not the world's: the next case starts
                # clean. One that fails on some ranks only still stalls the world.
                out.append(dict(case=case, error=traceback.format_exc()))
    return out


def _train_case(parallelize, simulate, rank: int, case: dict) -> dict:
    w = workload(case["model"])
    pm = parallelize(w.model, pp=case["pp"], tp=case.get("tp", 1), sp=case.get("sp", False),
                     microbatches=MICROBATCHES, schedule=case["schedule"],
                     chunks=case.get("chunks"), example_inputs=w.example_inputs,
                     loss_fn=w.loss_fn, partition=case.get("partition", "ilp"),
                     recompute=case.get("recompute", "none"),
                     # The matrix checks the runtime on fixed cuts; measured costs move
                     # the cuts run to run (they have their own tests and cases below).
                     costs=case.get("costs", "model"), split_loss=case.get("split_loss", False),
                     ep=case.get("ep", 1), vocab_passes=case.get("vocab_passes", False),
                     bucket_mb=case.get("bucket_mb", 25.0))
    losses, grads, norm = train(pm, w)
    # The schedule's own peak, from the simulator (independent of the executor).
    durations = None
    if pm.schedule.has_vocab_passes:  # S and T hold no stage's activations: any positive time
        from fxpipe.schedules.simulate import StageDurations

        p = pm.schedule.num_ranks
        durations = dataclasses.replace(StageDurations.uniform(pm.schedule.num_stages),
                                        vocab_forward=(1.0,) * p, vocab_backward=(1.0,) * p)
    bound = simulate(pm.schedule, durations).peak_in_flight[pm.groups.pp_rank]
    result = dict(case=case, losses=losses, peak=pm.last_stats.peak_in_flight, bound=bound,
                  grads=grads, norm=norm, chunked=sum(v.tp_replicated for v in pm.plan.values.values()),
                  scatter_gather=pm.executor.transport.scatter_gather is not None,
                  rows={n: r.ranks for n, r in pm.plan.row_shards.items()},
                  lookups=sorted({lk.table for lk in pm.plan.lookups}),
                  held={n: tuple(t.shape) for n, t in pm.state.items() if n in pm.plan.row_shards},
                  pp_rank=pm.groups.pp_rank,
                  lookup_peak=pm.executor.lookups.peak_parts if pm.executor.lookups is not None else 0)
    overlap = pm.grad_sync.overlap
    if overlap is not None:  # when each bucket's reduction started, against the step's last backward
        last = max((e for e in pm.last_stats.events if e[0].kind.name in ("B", "W")), key=lambda e: e[2])
        result["buckets"] = dict(launched=list(overlap.launched_at), last_backward=(last[1], last[2]),
                                 last_microbatch=last[0].microbatch, stages=len(set(pm.schedule.stages_of_rank(
                                     pm.groups.pp_rank))))
    full = pm.full_state_dict()
    if rank == 0:
        result["params"] = full
    pm.close()  # its process groups' threads would otherwise slow every later case
    return result


def stall_peer(rank: int, world: int, timeout_s: float) -> dict:
    """Rank 1 stops participating after set-up; rank 0's step must fail within the timeout."""
    import time

    from fxpipe.parallel import parallelize

    w = workload("gpt-tiny")
    pm = parallelize(w.model, pp=2, microbatches=2, example_inputs=w.example_inputs,
                     partition="uniform", timeout_s=timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 4)
        return {}
    start = time.perf_counter()
    try:
        pm.train_step(w.example_inputs)
    except Exception as exc:  # the timeout surfaces as a RuntimeError from gloo
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.perf_counter() - start}
    return {"error": None}


def wrong_shapes(rank: int, world: int) -> dict:
    from fxpipe.parallel import parallelize

    w = workload("gpt-tiny")
    pm = parallelize(w.model, pp=2, microbatches=2, example_inputs=w.example_inputs, partition="uniform")
    bad = tuple(t[:, :8] for t in w.example_inputs)
    try:
        pm.train_step(bad)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def mixed_precision(rank: int, world: int) -> dict:
    """bf16 and fp16 training next to fp32; fp16 with a scale that must overflow first."""
    from fxpipe.parallel import parallelize
    from tests.runtime._reuse_capture import captures_reused

    out = {}
    with captures_reused():  # fp16 twice: the second run reuses the first's capture
        for precision, scaler in (("bf16", None), ("fp16", {"scale": 2.0 ** 8}),
                                  ("fp16-overflow", {"scale": 2.0 ** 40, "growth_interval": 1000})):
            w = workload("gpt-tiny")
            pm = parallelize(w.model, pp=2, microbatches=2, example_inputs=w.example_inputs,
                             partition="uniform", precision=precision.split("-")[0], loss_scaler=scaler)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
            before = {n: t.detach().clone() for n, t in pm.named_parameters()}
            losses, skipped, dtypes = [], [], set()
            for _ in range(STEPS):
                losses.append(pm.train_step(w.example_inputs))
                skipped.append(pm.last_step_skipped)
                opt.step()
            dtypes = {str(v.spec.dtype) for v in pm.plan.values.values()}
            unchanged = all(torch.equal(before[n], t) for n, t in pm.named_parameters())
            out[precision] = dict(losses=losses, skipped=skipped, dtypes=dtypes, unchanged=unchanged,
                                  master_dtypes={str(t.dtype) for _, t in pm.named_parameters()},
                                  scale=pm.master.loss_scale)
    return out
