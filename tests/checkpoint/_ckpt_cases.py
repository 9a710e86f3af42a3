"""Checkpoint cases run inside spawned gloo workers (importable by the children).

One function per spawned world, each running several checks, because spawning and
compiling dominate on a 2-core machine.
"""
from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import numpy as np
import torch

from fxpipe.models import build_workload
from tests.runtime._reuse_capture import reusing_captures

BATCH, SEQ, LAYERS, MICROBATCHES = 8, 16, 4, 4
STEPS, SAVE_AT = 4, 2
EVAL_STEP = 99


ROWS = "tests.runtime._wide_vocab:workload"
"""An LM head whose rows the pipeline ranks own (passes/vocab_rows.py)."""
ROWS_LAYOUT = dict(partition="ilp", costs="model", split_loss=True)
"""What splits the head over the stages (the uniform partition leaves ops whole)."""
VOCAB_LAYOUT = dict(partition="ilp", costs="model", vocab_passes=True)
"""The head run as vocabulary passes: rank r owns block r of its rows (and of the embedding)."""


def workload(name: str = "gpt-tiny", *, seed: int = 0, layers: int = LAYERS):
    if name == ROWS:  # a user model: its vocabulary and label convention stated here
        import dataclasses

        from tests.runtime._wide_vocab import VOCAB
        torch.manual_seed(seed)
        return dataclasses.replace(build_workload(name), vocab_size=VOCAB, labels_shifted=False)
    return build_workload(name, batch=BATCH, seq=SEQ, layers=layers, seed=seed)


def batch(w, step: int) -> tuple[torch.Tensor, ...]:
    """The batch of ``step``: a pure function of the step."""
    gen = torch.Generator().manual_seed(1000 + step)
    return w.batch_from_tokens(torch.randint(0, w.vocab_size, (BATCH, SEQ + 1), generator=gen))


def build(name: str, pp: int, dp: int | None = None, *, tp: int = 1, seed: int = 0, layers: int = LAYERS,
          partition: str = "uniform", **options):
    """(ParallelModel, workload, AdamW, LR schedule). The learning rate decays, so a
    resume must restore the optimizer's param-group lr, not only its moments.
    ``options``: more ``parallelize`` arguments (precision, loss_scaler)."""
    from fxpipe.parallel import parallelize

    w = workload(name, seed=seed, layers=layers)
    pm = parallelize(w.model, tp=tp, pp=pp, dp=dp, microbatches=MICROBATCHES, example_inputs=batch(w, 0),
                     loss_fn=w.loss_fn, partition=partition, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return pm, w, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))


def train(pm, w, opt, sched, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(pm.train_step(batch(w, step)))
        opt.step()
        sched.step()
    return losses


def rng_sample() -> list[float]:
    """Draws from every generator a checkpoint restores."""
    return [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]


def _scramble_rng() -> None:
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)


@reusing_captures
def world_pp2(rank: int, world: int, root: str, killed_dir: str) -> dict:
    """pp=2: the uninterrupted run (saving at SAVE_AT), resume, kill-recovery, exports."""
    from fxpipe.checkpoint.dcp import list_checkpoints, load_checkpoint, save_checkpoint
    from fxpipe.checkpoint.export import export_consolidated

    root_path, out = Path(root), {}
    pm, w, opt, sched = build("gpt-tiny", pp=2)
    losses = train(pm, w, opt, sched, range(SAVE_AT))
    save_checkpoint(pm, opt, SAVE_AT, root_path / "run", extra={"lr_scheduler": sched.state_dict()})
    out["rng_after_save"] = rng_sample()
    out["losses"] = losses + train(pm, w, opt, sched, range(SAVE_AT, STEPS))
    out["params"] = pm.full_state_dict()
    export_consolidated(pm, root_path / "gpt.pt")
    out["eval_loss"] = pm.train_step(batch(w, EVAL_STEP))
    for step in (1, 2, 3, 3):  # pruning, and a second save of an existing step
        save_checkpoint(pm, opt, step, root_path / "keep", keep_last=2)
    out["kept"] = [s for s, _ in list_checkpoints(root_path / "keep")]

    # Resume: a new ParallelModel from another init, with other RNG states.
    _scramble_rng()
    pm, w, opt, sched = build("gpt-tiny", pp=2, seed=1)
    step, extra = load_checkpoint(pm, opt, root_path / "run")
    sched.load_state_dict(extra["lr_scheduler"])
    out["resumed_step"], out["rng_after_load"] = step, rng_sample()
    out["resumed_losses"] = train(pm, w, opt, sched, range(step, STEPS))
    out["resumed_params"] = pm.full_state_dict()

    # The save killed mid-way (pp=1) left step 2 as .tmp: loading takes step 1.
    out["killed_step"], _ = load_checkpoint(pm, None, killed_dir)
    out["killed_params"] = pm.full_state_dict()

    other, *_ = build("gpt-tiny", pp=2, layers=2)
    try:
        load_checkpoint(other, None, root_path / "run")
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)

    pm, w, opt, sched = build("hf:gpt2", pp=2)
    train(pm, w, opt, sched, range(2))
    export_consolidated(pm, root_path / "hf_gpt2.pt")
    export_consolidated(pm, root_path / "hf_gpt2_dir", hf_config=w.model.config)  # safetensors + config
    out["hf_eval_loss"] = pm.train_step(batch(w, EVAL_STEP))

    for precision, scaler in (("bf16", None), ("fp16", FP16_SCALER)):
        out[precision] = _precision_resume(root_path / precision, precision, scaler)
    out["rows"] = _rows_run(rank, root_path, "rows", ROWS_LAYOUT)
    out["vocab_rows"] = _rows_run(rank, root_path, "vocab_rows", VOCAB_LAYOUT)
    return out


def _rows_run(rank: int, root: Path, name: str, layout: dict) -> dict:
    """The wide-vocabulary model at pp=2 with its head rows owned per rank (``layout``:
    split loss blocks, or vocabulary passes): saving at SAVE_AT without gathering into
    ``root / name``, and its export (safetensors, whole tensors) into ``name_export``.
    Also reports the rank's pipeline and TP coordinates."""
    from fxpipe.checkpoint.dcp import save_checkpoint
    from fxpipe.checkpoint.export import export_consolidated

    pm, w, opt, sched = build(ROWS, pp=2, **layout)
    r = dict(rows={n: rows.ranks for n, rows in pm.plan.row_shards.items()},
             local={n: tuple(t.shape) for n, t in pm.state.items()},
             pp_rank=pm.groups.pp_rank, tp_rank=pm.groups.tp_rank)
    losses = train(pm, w, opt, sched, range(SAVE_AT))
    with no_gather():
        save_checkpoint(pm, opt, SAVE_AT, root / name, extra={"lr_scheduler": sched.state_dict()})
    r["losses"] = losses + train(pm, w, opt, sched, range(SAVE_AT, STEPS))
    params = pm.full_state_dict()
    export_consolidated(pm, root / f"{name}_export", hf_config=w.model.config)
    if rank == 0:
        r["params"] = params
    return r


# fp16: the first steps overflow (the scale halves, steps are skipped), then the scale
# grows every 2 clean steps, so the scaler's state changes between save and resume.
FP16_SCALER = {"scale": 2.0 ** 18, "growth_interval": 2}


def _precision_resume(directory: Path, precision: str, scaler: dict | None) -> dict:
    """Mixed precision: the uninterrupted run saving at SAVE_AT, then the same
    ParallelModel rewound by loading (its masters, compute copies, optimizer, LR and
    loss scale have all moved on since the save, so each must come from the checkpoint)."""
    from dataclasses import asdict

    from fxpipe.checkpoint.dcp import load_checkpoint, save_checkpoint

    pm, w, opt, sched = build("gpt-tiny", pp=2, precision=precision, loss_scaler=scaler)
    losses = train(pm, w, opt, sched, range(SAVE_AT))
    save_checkpoint(pm, opt, SAVE_AT, directory, extra={"lr_scheduler": sched.state_dict()})
    r = dict(scaler_saved=asdict(pm.master.scaler) if pm.master.scaler else None)
    r["losses"] = losses + train(pm, w, opt, sched, range(SAVE_AT, STEPS))
    r["masters"] = {n: t.detach().clone() for n, t in pm.named_parameters()}
    r["scaler_end"] = asdict(pm.master.scaler) if pm.master.scaler else None
    step, extra = load_checkpoint(pm, opt, directory)
    sched.load_state_dict(extra["lr_scheduler"])
    r["scaler_loaded"] = asdict(pm.master.scaler) if pm.master.scaler else None
    r["resumed_losses"] = train(pm, w, opt, sched, range(step, STEPS))
    r["resumed_masters"] = {n: t.detach().clone() for n, t in pm.named_parameters()}
    r["scaler_resumed_end"] = asdict(pm.master.scaler) if pm.master.scaler else None
    r["dtypes"] = {str(t.dtype) for t in pm.state.values()}
    return r


@contextlib.contextmanager
def no_gather():
    """Checkpoints never gather shards: ``ParallelModel.unshard_tp`` and ``gather_full``
    (the only ways fxpipe builds full tensors from shards) fail the case in this block."""
    from fxpipe.runtime.api import ParallelModel

    def refuse(self, local):
        raise AssertionError("a checkpoint save/load gathered tensor-parallel shards")

    saved = ParallelModel.unshard_tp, ParallelModel.gather_full
    ParallelModel.unshard_tp = ParallelModel.gather_full = refuse
    try:
        yield
    finally:
        ParallelModel.unshard_tp, ParallelModel.gather_full = saved


def _resume(rank: int, pm, w, opt, sched, directory: Path) -> dict:
    """Load ``directory`` into a built ParallelModel, train to STEPS, report."""
    from fxpipe.checkpoint.dcp import load_checkpoint

    _scramble_rng()
    with no_gather():
        step, extra = load_checkpoint(pm, opt, directory)
    sched.load_state_dict(extra["lr_scheduler"])
    r = dict(step=step, rng=rng_sample(), losses=train(pm, w, opt, sched, range(step, STEPS)))
    params = pm.full_state_dict()
    if rank == 0:
        r["params"] = params
    return r


@reusing_captures
def world_reshard(rank: int, world: int, root: str) -> dict:
    """World 4. The tensor-parallel run: tp=2 × pp=2, saving at SAVE_AT ("tp2"), its
    export; then checkpoints across layouts, keyed (layout, checkpoint): the pp=2 one
    ("run", from world_pp2) into tp=2 × pp=2, pp=4 and dp=2 × pp=2, and the tp=2 × pp=2
    one into pp=4, tp=1 × dp=2 × pp=2 and tp=4. A ParallelModel loads several
    checkpoints in turn (each load replaces its whole state): compiling dominates."""
    from fxpipe.checkpoint.dcp import save_checkpoint
    from fxpipe.checkpoint.export import export_consolidated

    root_path, out = Path(root), {}
    pm, w, opt, sched = build("gpt-tiny", tp=2, pp=2)
    losses = train(pm, w, opt, sched, range(SAVE_AT))
    with no_gather():
        save_checkpoint(pm, opt, SAVE_AT, root_path / "tp2", extra={"lr_scheduler": sched.state_dict()})
    tp_run = dict(losses=losses + train(pm, w, opt, sched, range(SAVE_AT, STEPS)))
    params = pm.full_state_dict()
    export_consolidated(pm, root_path / "gpt_tp2.pt")
    tp_run["eval_loss"] = pm.train_step(batch(w, EVAL_STEP))
    if rank == 0:
        tp_run["params"] = params
    out["tp2"] = tp_run
    out[("tp2xpp2", "run")] = _resume(rank, pm, w, opt, sched, root_path / "run")

    for layout, tp, pp, dp, checkpoints in (("pp4", 1, 4, 1, ("run", "tp2")),
                                             ("dp2xpp2", 1, 2, 2, ("run", "tp2")),
                                             ("tp4", 4, 1, 1, ("tp2",))):
        pm, w, opt, sched = build("gpt-tiny", tp=tp, pp=pp, dp=dp, seed=1)
        for name in checkpoints:
            out[(layout, name)] = _resume(rank, pm, w, opt, sched, root_path / name)
    # The pp=2 checkpoint of owned head rows into another row layout: four ranks' rows.
    pm, w, opt, sched = build(ROWS, pp=4, seed=1, **ROWS_LAYOUT)
    out[("pp4", "rows")] = _resume(rank, pm, w, opt, sched, root_path / "rows")
    out[("pp4", "rows")]["rows"] = {n: rows.ranks for n, rows in pm.plan.row_shards.items()}
    # The pp=2 checkpoint of the vocabulary passes' blocks into the same four ranks' rows.
    out[("pp4", "vocab_rows")] = _resume(rank, pm, w, opt, sched, root_path / "vocab_rows")
    out[("pp4", "vocab_rows")]["rows"] = out[("pp4", "rows")]["rows"]
    # tp=2 × pp=2 with vocabulary passes: each rank owns a block of its TP shard's rows.
    # Its checkpoint (written here) resumes into the pp=4 rows layout, and the pp=2
    # vocabulary passes' checkpoint into it.
    out["tp2_vocab_rows"] = _rows_run(rank, root_path, "tp2_vocab_rows", dict(VOCAB_LAYOUT, tp=2))
    out[("pp4", "tp2_vocab_rows")] = _resume(rank, pm, w, opt, sched, root_path / "tp2_vocab_rows")
    pm, w, opt, sched = build(ROWS, pp=2, tp=2, seed=1, **VOCAB_LAYOUT)
    out[("tp2xpp2", "vocab_rows")] = _resume(rank, pm, w, opt, sched, root_path / "vocab_rows")
    # HF GPT-2 at tp=2 × pp=2: its Conv1D c_attn weight [h, 3h] is split by columns, so a
    # rank's ranges are not contiguous views (saved from copies, loaded back through them).
    pm, w, opt, sched = build("hf:gpt2", tp=2, pp=2)
    losses = train(pm, w, opt, sched, range(SAVE_AT))
    with no_gather():
        save_checkpoint(pm, opt, SAVE_AT, root_path / "hf_tp2", extra={"lr_scheduler": sched.state_dict()})
    out["hf_tp2"] = dict(losses=losses + train(pm, w, opt, sched, range(SAVE_AT, STEPS)))
    params = pm.full_state_dict()
    if rank == 0:
        out["hf_tp2"]["params"] = params
    pm, w, opt, sched = build("hf:gpt2", tp=2, pp=2, seed=1)
    out[("tp2xpp2", "hf_tp2")] = _resume(rank, pm, w, opt, sched, root_path / "hf_tp2")
    return out


def save_then_hang(directory: str, expected: str, store: str) -> None:
    """A world of one saves step 1, then hangs inside the save of step 2 after DCP wrote
    its data (before the index, the rename and the pointer) until the test kills it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from fxpipe.checkpoint.dcp import save_checkpoint

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    pm, w, opt, sched = build("gpt-tiny", pp=1)
    train(pm, w, opt, sched, range(1))
    save_checkpoint(pm, opt, 1, directory)
    torch.save(pm.full_state_dict(), expected)
    train(pm, w, opt, sched, range(1, 2))
    write_data = FileSystemWriter.write_data

    def write_then_hang(self, plan, planner):
        write_data(self, plan, planner).wait()
        print("WRITTEN", flush=True)
        time.sleep(600)

    FileSystemWriter.write_data = write_then_hang
    save_checkpoint(pm, opt, 2, directory)
