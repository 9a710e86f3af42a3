"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume in any layout, export.

Every rank hands DCP a flat dict keyed by *original* parameter names, of tensors of
the *full* shape: replicated tensors as they are, tensor-parallel shards as
ShardedTensors holding only this rank's ranges (``shard_chunks.py``), so the
checkpoint does not depend on the layout that wrote it and no rank gathers a full
tensor: a rank of another tp/pp/dp layout asks for the names it holds and its own
ranges, and DCP reads the overlapping parts of the saved chunks (it reshards by key
and offset). Keys (all tensors, so DCP reads them back with ``torch.load(weights_only=True)``):

    model.<name>                      parameters (fp32 masters under mixed precision) and
                                      buffers, one per tied group, global (unsharded) shape
    optim.state.<name>.<key>          torch.optim state (AdamW: step, exp_avg, exp_avg_sq),
                                      tensors of the parameter's shape chunked as well
    optim.param_groups.<name>.<key>   numeric hyper-parameters of the name's group (lr, betas, ...)
    rng.<rank>.<generator>            torch CPU/CUDA, python ``random`` and numpy states

A name held by several ranks (data-parallel replicas, tied copies on the first and
last stage, the tp ranks' identical gathered tensors) is written once: DCP's default
planner deduplicates equal keys (``_dedup_save_plans``). The step, ``extra``, the
layout and the fp16 loss scaler go to ``fxpipe.json`` (JSON, never pickled). The
directory protocol that makes saves atomic is in ``files.py``; the
user-facing story in docs/checkpoints.md.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils._pytree import tree_leaves

from fxpipe.checkpoint.files import (POINTER_FILE, SafeReader, adopt_run, commit, committed, latest_checkpoint,
                                     list_checkpoints, prune, read_pointer, remove_debris, remove_other_runs, resolve,
                                     run_id, step_dirname, temporary, write_atomic)
from fxpipe.checkpoint.lock import CheckpointLockError, acquire
from fxpipe.checkpoint.manifest import (FORMAT, META_FILE, CheckpointFallbackWarning, CorruptCheckpointError, digest,
                                        file_names, read_manifest, verify, with_digest)
from fxpipe.checkpoint.metadata import UnsafeCheckpointError
from fxpipe.checkpoint.state import (_SCALER_FIELDS, _check_model, _install_optimizer, _local_targets, _model_state,
                                     _model_tensors, _optimizer_names, _optimizer_state, _rng_state, _scaler_state,
                                     _set_rng, _targets, read_dcp, state_dict_names)
from fxpipe.runtime.api import ParallelModel
from fxpipe.runtime.launch import rank0_decides

__all__ = ["CheckpointFallbackWarning", "CorruptCheckpointError", "latest_checkpoint",
           "list_checkpoints", "load_checkpoint", "save_checkpoint", "state_dict_names", "step_dirname"]


# ---- save ------------------------------------------------------------------------------------
def save_checkpoint(pm: "ParallelModel", optimizer: torch.optim.Optimizer, step: int, directory: str | os.PathLike,
                    *, extra: dict | None = None, keep_last: int | None = 3, overwrite: bool = False) -> Path:
    """Save this job's state after ``step`` optimizer steps; collective (every rank calls).

    Written to ``step_XXXXXXX.<job>.tmp`` and renamed to ``step_XXXXXXX`` by rank 0 once
    every rank's data and DCP's index are on disk; then ``latest`` is replaced and
    all but the newest ``keep_last`` checkpoints of this run are removed (None: keep
    all); another run's are never pruned, unless ``overwrite`` (``fxpipe run
    --overwrite``), which removes every other run's checkpoints. ``extra`` must be JSON-serialisable and the same on every rank (rank 0's is kept).
    Returns the checkpoint's directory."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    try:  # on every rank, so a bad ``extra`` fails everywhere before any collective
        extra_json = json.loads(json.dumps(extra or {}))
    except TypeError as exc:
        raise TypeError(f"checkpoint extra must be JSON-serialisable: {exc}") from exc
    names = _optimizer_names(pm, optimizer)
    state = {**_model_state(pm), **_optimizer_state(pm, optimizer, names),
             **_rng_state(dist.get_rank(), pm.device, getattr(pm, "tp_rng", None))}
    mesh = pm.groups.mesh
    meta = dict(step=step, extra=extra_json, world_size=dist.get_world_size(),
                mesh=dict(pp=mesh.pp, dp=mesh.dp, tp=mesh.tp), source=pm.plan.program.source,
                precision=pm.master.precision.value if pm.master is not None else "fp32",
                loss_scaler=_scaler_state(pm), state_dict=state_dict_names(pm.plan.program),
                torch=torch.__version__)
    return write_checkpoint(state, directory, step, meta, keep_last, overwrite=overwrite)


def write_checkpoint(state: dict[str, Any], directory: str | os.PathLike, step: int, meta: dict[str, Any],
                     keep_last: int | None, *, overwrite: bool = False) -> Path:
    """The directory protocol of a save (docs/checkpoints.md), for any DCP state dict:
    lock, this job's temporary, ``dcp.save``, per-rank digests, the manifest, the atomic
    rename, ``latest``, the atomic prune. ``meta`` (rank 0's) goes into the manifest.
    Collective."""
    rank, root = dist.get_rank(), Path(directory)
    final = root / step_dirname(step)
    def prepare() -> str:  # the job's lock on the directory, then its own temporary
        acquire(root)
        remove_debris(root)  # only killed saves' and prunes' leftovers: we hold the lock
        tmp = temporary(final)
        tmp.mkdir()
        return str(tmp)

    # Every rank fails alike, none waits in a barrier.
    tmp = Path(rank0_decides(prepare, as_raised=(CheckpointLockError, OSError)))
    # DCP returns on every rank only after rank 0 wrote .metadata (its "finish" step).
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))
    except CheckpointException as exc:  # a BaseException holding every rank's traceback
        raise save_error(exc, final, tmp, state) from None
    # Each rank hashes the data file it wrote (DCP names rank r's files __r_*.distcp): the
    # digests cost one read of the checkpoint in all, spread over the ranks.
    files: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(files, {f.name: digest(f) for f in tmp.glob(f"__{rank}_*.distcp")})
    if rank == 0:
        listed = {name: d for part in files for name, d in part.items()}
        on_disk = {f.name for f in tmp.glob("*.distcp")}
        if on_disk != set(listed):
            raise RuntimeError(f"checkpoint {tmp}: data files {sorted(on_disk)} but the ranks hashed "
                               f"{sorted(listed)}; not committing it")
        listed[".metadata"] = digest(tmp / ".metadata")
        run = run_id(root)
        manifest = with_digest(dict(format=FORMAT, **meta, run=run, files=dict(sorted(listed.items()))))
        write_atomic(tmp / META_FILE, json.dumps(manifest, indent=1).encode())
        commit(tmp, final)
        write_atomic(root / POINTER_FILE, (final.name + "\n").encode())
        if overwrite:
            remove_other_runs(root, run, keep=final)
        if keep_last is not None:
            prune(root, keep_last, keep=final, run=run)
    dist.barrier()
    return final


def save_error(exc: CheckpointException, final: Path, tmp: Path, state: dict[str, Any]) -> Exception:
    """DCP's failure of a save as one error a user can act on: a full disk named as
    ENOSPC with the bytes this rank writes and the bytes free, anything else as the
    first failing rank's error in one line. The checkpoints before it are untouched."""
    failures = {rank: (f[0] if isinstance(f, tuple) else f) for rank, f in exc.failures.items()}
    for rank, error in sorted(failures.items()):
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            need = sum(t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor))
            try:
                free = shutil.disk_usage(tmp).free
            except OSError:
                free = 0
            return OSError(errno.ENOSPC, f"checkpoint {final}: no space left on device (ENOSPC) writing in {tmp.parent}: "
                                         f"this rank writes about {need} bytes ({need / 2**30:.2f} GiB), {free} are free; "
                                         f"free space or choose another --checkpoint-dir (the checkpoints before it are "
                                         f"intact)")
    rank, error = sorted(failures.items())[0]
    text = " ".join(str(error).split())[:300]
    return RuntimeError(f"checkpoint {final}: the save failed on rank(s) {sorted(failures)}; rank {rank}: "
                        f"{type(error).__name__}: {text} (the checkpoints before it are intact)")


def local_problems(path: Path, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems with checkpoint ``path`` seen by one process: its manifest, and the
    digests of its share of the files (file i is read by share i mod n); share 0 also
    validates DCP's index (allow-list and structure). Empty if intact."""
    index, count = share
    if path.is_symlink():
        return [f"{path} is a symbolic link; fxpipe does not follow links in a checkpoint directory"]
    try:
        meta = read_manifest(path)
        problems = verify(path, meta, file_names(meta)[index::count])
        if index == 0 and not problems:
            md = SafeReader(path).read_metadata()
            unlisted = sorted({i.relative_path for i in md.storage_data.values()} - set(meta.get("files", ())))
            if meta["format"] >= 2 and unlisted:  # data that no digest covers
                problems.append(f"{path / '.metadata'} refers to {unlisted[:4]}, which {path / META_FILE} "
                                f"does not list")
        return problems
    except (CorruptCheckpointError, UnsafeCheckpointError, OSError) as exc:
        return [str(exc)]


def candidates(directory: str | os.PathLike, step: int | None) -> tuple[list[Path], list[str]]:
    """What a resume tries, in order, and notes for the warning: the checkpoint of
    ``step``; or the one ``latest`` names, then every other ``step_N`` directory newest
    first. Incomplete ones are tried too (they fail at once, without reading any data)
    so that a resume names what it skipped: a renamed directory is complete unless a
    file was lost or damaged after the save."""
    root = Path(directory)
    if step is not None:
        return [resolve(root, step)], []
    found = [p for _, p in reversed(committed(root))]
    if not found:
        resolve(root, None)  # raises FileNotFoundError naming the directory
    target, note = read_pointer(root)
    first = [target] if target in found else []
    return first + [p for p in found if p != target], [note] if note else []


def pick_intact(paths: list[Path], problems_of: Any, strict: bool,
                notes: list[str] | tuple[str, ...] = ()) -> tuple[Path, list[str]]:
    """The first of ``paths`` without problems, and ``notes`` plus a note per damaged
    one skipped (each naming a file); with ``strict`` (an explicit step) a damaged
    first choice is an error."""
    skipped = list(notes)
    for path in paths:
        problems = problems_of(path)
        if not problems:
            return path, skipped
        if strict:
            raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems[:4])}. Without "
                                         f"--resume-from, --resume takes the newest intact checkpoint")
        skipped.append(f"{path.name}: {problems[0]}")
    raise CorruptCheckpointError(f"no intact checkpoint in {paths[0].parent}: " + "; ".join(skipped))


def choose_intact(directory: str | os.PathLike, step: int | None) -> tuple[Path, dict]:
    """The checkpoint to load and its manifest (``candidates`` / ``pick_intact``), every
    file verified once, shared out over the ranks. Takes the directory's lock (this job
    will save there). Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    def listed() -> tuple[list[str], Any]:
        acquire(directory)
        paths, notes = candidates(directory, step)
        return [str(p) for p in paths], notes

    # Every rank fails alike, and tries the same paths.
    paths, notes = rank0_decides(listed, as_raised=(CheckpointLockError, FileNotFoundError))

    def shared_problems(path: Path) -> list[str]:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, local_problems(path, (rank, world)))
        return sorted({p for part in gathered for p in part})

    path, skipped = pick_intact([Path(p) for p in paths], shared_problems, strict=step is not None, notes=notes)
    if skipped and rank == 0:
        warnings.warn(f"resuming from {path}, skipping: " + "; ".join(skipped), CheckpointFallbackWarning,
                      stacklevel=3)
    meta = read_manifest(path)
    adopt_run(directory, meta.get("run"))  # this job continues that run: its saves prune its steps
    return path, meta


def load_checkpoint(pm: "ParallelModel", optimizer: torch.optim.Optimizer | None, directory: str | os.PathLike,
                    *, step: int | None = None) -> tuple[int, dict]:
    """Restore parameters, optimizer state and RNG from the latest complete checkpoint
    in ``directory`` (or the one of ``step``); collective. Returns (step, extra).

    Works for any tp/pp/dp layout: each rank reads the full tensors of the names it
    holds and keeps its tensor-parallel shard. Under mixed precision the fp32 masters
    are loaded (and the compute copies refreshed from them), and fp16's loss scaler is
    restored when the checkpoint has one. RNG states are per rank, so they are restored
    rank by rank only when the layout is the one that saved; otherwise every rank takes
    rank 0's (as a fresh run seeds all ranks alike)."""
    path, meta = choose_intact(directory, step)
    saved = SafeReader(path).read_metadata().state_dict_metadata
    program = pm.plan.program
    _check_model(program, pm.specs, saved, path)
    mesh = pm.groups.mesh
    same_layout = meta["mesh"] == dict(pp=mesh.pp, dp=mesh.dp, tp=mesh.tp)
    rng_prefix = f"rng.{dist.get_rank() if same_layout else 0}."
    live = _model_tensors(pm)
    model = _local_targets(pm, saved, "model.", lambda key: key[len("model."):], set(live))
    names = _optimizer_names(pm, optimizer) if optimizer is not None else []
    optim = _local_targets(pm, saved, "optim.", lambda key: key.split(".", 2)[2].rsplit(".", 1)[0], set(names))
    rng = _targets(saved, rng_prefix)
    # Into CPU buffers of the checkpoint's dtypes: this rank's tensor-parallel ranges
    # only (DCP reads the overlapping parts of the saved chunks), full replicated tensors.
    read_dcp({**{k: t for k, (t, _) in model.items()}, **{k: t for k, (t, _) in optim.items()}, **rng}, path)
    with torch.no_grad():
        for name, t in live.items():
            if f"model.{name}" in model:  # a non-persistent buffer not saved keeps its init's value
                t.copy_(model[f"model.{name}"][1]())  # casts (an fp32 checkpoint into bf16 buffers, and back)
    if pm.master is not None:
        pm.master.refresh()  # train_step does it too; now the compute copies match at once
        scaler, saved_scaler = pm.master.scaler, meta.get("loss_scaler")
        if scaler is not None and saved_scaler:  # fp16 from fp16; else the run's own scaler
            for field in _SCALER_FIELDS:
                setattr(scaler, field, type(getattr(scaler, field))(saved_scaler[field]))
    if optimizer is not None:
        _install_optimizer(optimizer, names, {k: local() for k, (_, local) in optim.items()})
    # TP dropout streams are per tp rank: restored only into the layout that saved them
    # (elsewhere they restart from the seed, as in a fresh run).
    _set_rng({k[len(rng_prefix):]: v for k, v in rng.items()}, pm.device,
             getattr(pm, "tp_rng", None) if same_layout else None)
    return int(meta["step"]), meta["extra"]
