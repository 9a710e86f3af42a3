"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume in any layout, export.

Every rank hands DCP a flat dict keyed by *original* parameter names, of tensors of
the *full* shape: replicated tensors as they are, tensor-parallel shards as
ShardedTensors holding only this rank's ranges (``checkpoint_shards.py``), so the
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
directory protocol that makes saves atomic is in ``checkpoint_files.py``; the
user-facing story in docs/checkpoints.md.
"""
from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from fxpipe.ir.shard_spec import ShardSpec
from fxpipe.ir.state_mismatch import full_shapes, raise_if_mismatched
from fxpipe.ir.program import ParamKind, Program
from fxpipe.checkpoint.shard_chunks import empty_chunks, first_held, is_sharded, restrict, wrap_state
from fxpipe.checkpoint.files import (POINTER_FILE, SafeReader, adopt_run, commit, committed,
                                             latest_checkpoint, list_checkpoints, prune, read_pointer,
                                             remove_debris, remove_other_runs, resolve, run_id, step_dirname,
                                             temporary, write_atomic)
from fxpipe.checkpoint.lock import CheckpointLockError, acquire
from fxpipe.checkpoint.manifest import (FORMAT, META_FILE, SCALER_FIELDS, CheckpointFallbackWarning,
                                                CorruptCheckpointError, digest, file_names, read_manifest, verify,
                                                with_digest)
from fxpipe.checkpoint.metadata import UnsafeCheckpointError

if TYPE_CHECKING:
    from fxpipe.runtime.api import ParallelModel

__all__ = ["CheckpointFallbackWarning", "CorruptCheckpointError", "export_consolidated", "latest_checkpoint",
           "list_checkpoints", "load_checkpoint", "save_checkpoint", "state_dict_names", "step_dirname"]


# ---- what is saved ---------------------------------------------------------------------------
def _is_persistent(info: Any) -> bool:
    """In the model's ``state_dict()``: parameters and persistent buffers."""
    return info.kind is ParamKind.PARAMETER or info.persistent


def state_dict_names(program: Program) -> dict[str, str]:
    """What ``model.state_dict()`` holds: every original name -> its canonical name
    (tied names all map to their group's tensor)."""
    return {p.name: p.canonical for p in program.params
            if p.kind is not ParamKind.CONSTANT and _is_persistent(p)}


def _model_tensors(pm: "ParallelModel") -> dict[str, torch.Tensor]:
    """This rank's live model tensors by canonical name (tensor-parallel shards): the
    fp32 masters for trained parameters under mixed precision (the compute copies are
    refreshed from them at every ``train_step``), else ``pm.state``; buffers from ``pm.state``."""
    kinds = {p.canonical: p.kind for p in pm.plan.program.params}
    masters = pm.master.masters if pm.master is not None else {}
    return {n: masters.get(n, t) for n, t in pm.state.items() if kinds[n] is not ParamKind.CONSTANT}


def _saved_model_tensors(pm: "ParallelModel") -> dict[str, torch.Tensor]:
    """What this rank writes: under ZeRO-1 a trained tensor only by its owner (the one
    with its fp32 master); DCP merges the ranks' keys."""
    return {n: t for n, t in _model_tensors(pm).items() if pm.owns(n)}


def _tp_ranks(pm: "ParallelModel") -> list[int]:
    """Global ranks of this rank's tp group, in tp order (tp is innermost in the mesh)."""
    base = pm.groups.rank - pm.groups.tp_rank
    return [base + t for t in range(pm.groups.mesh.tp)]


def _chunked(pm: "ParallelModel", tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's shards (tensor-parallel, and rows split over pipeline ranks) as DCP
    chunks of the full shape (no gather; ``checkpoint_shards.py``); everything else as
    it is. A row held by several pipeline ranks is written by the lowest of them."""
    specs = dict(pm.specs)
    if not any(is_sharded(s) for s in specs.values()):
        return tensors
    keeps = {}
    for name, rows in pm.plan.row_shards.items():
        if name in specs and rows.ranks[pm.groups.pp_rank]:
            keep = first_held(rows, pm.groups.pp_rank)
            if len(keep) < rows.local_rows(pm.groups.pp_rank):
                keeps[name] = keep
                if keep:
                    specs[name] = restrict(specs[name], keep)
    out = {}
    for name, t in tensors.items():
        keep = keeps.get(name)
        if keep is not None:
            if not keep:
                continue  # every row written by a lower pipeline rank (the step counter too)
            if t.dim() and t.shape[0] == pm.specs[name].local_shape[0]:
                t = t.index_select(0, torch.tensor(keep, dtype=torch.long, device=t.device))
        out[name] = t
    return wrap_state(out, specs, pm.groups.tp_rank, _tp_ranks(pm), pm.groups.tp_group)


def _model_state(pm: "ParallelModel") -> dict[str, Any]:
    pm.sync_parameters()  # after an optimizer step, every copy current (ZeRO-1: the owners')
    local = _chunked(pm, {n: t.detach() for n, t in _saved_model_tensors(pm).items()})
    if pm.groups.pp_rank == 0:  # buffers no stage reads are in no rank's state: the Program's copy
        held = {n for st in range(pm.plan.num_stages) for n in pm.plan.stage_params(st)}
        program = pm.plan.program
        # A model built on meta never materialises a buffer no stage reads: nothing to save.
        local.update({p.canonical: program.state[p.canonical].detach().cpu() for p in program.params
                      if p.kind is ParamKind.BUFFER and p.canonical not in held
                      and not program.state[p.canonical].is_meta})
    return {f"model.{n}": t for n, t in local.items()}


def _optimizer_names(pm: "ParallelModel", optimizer: torch.optim.Optimizer) -> list[str]:
    """Original name of each parameter in torch.optim's index order (groups in order)."""
    by_id = {id(t): n for n, t in pm.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not one "
                                 f"of this ParallelModel's parameters; build it from pm.parameters()")
            names.append(by_id[id(p)])
    return names


def _is_number(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return bool(v) and all(_is_number(x) for x in v)
    return isinstance(v, torch.Tensor) or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _optimizer_state(pm: "ParallelModel", optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    sd = optimizer.state_dict()
    by_key: dict[str, dict[str, torch.Tensor]] = {}  # state key -> parameter name -> tensor
    for index, entries in sd["state"].items():
        for key, value in entries.items():
            by_key.setdefault(key, {})[names[index]] = torch.as_tensor(value)
    out = {}
    for key in sorted(by_key):
        # Moments (exp_avg, exp_avg_sq) have the parameter's shape: chunked with its
        # ShardSpec like the parameter. Scalars (step) are the same on every tp rank.
        for name, t in _chunked(pm, by_key[key]).items():
            out[f"optim.state.{name}.{key}"] = t
    for group in sd["param_groups"]:
        # Numbers only (lr, initial_lr, betas, eps, weight_decay): flags such as foreach
        # or fused describe how the optimizer was built, which the loader's run decides.
        for key, value in group.items():
            if key != "params" and _is_number(value):
                for index in group["params"]:
                    out[f"optim.param_groups.{names[index]}.{key}"] = torch.as_tensor(value, dtype=torch.float64)
    return out


def _rng_state(rank: int, device: torch.device, tp_rng: Any = None) -> dict[str, torch.Tensor]:
    version, words, gauss = random.getstate()  # Mersenne Twister: 624 words + position
    assert version == 3, version
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {"torch": torch.get_rng_state(),
           "python": torch.tensor(words, dtype=torch.int64),
           "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
           "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
           "numpy_rest": torch.tensor([pos, has_gauss, cached], dtype=torch.float64)}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    if tp_rng is not None:  # the TP dropout streams (Megatron's RNG tracker), per rank
        for (dev, sharded), state in tp_rng.get_state().items():
            out[f"tp_{dev}_{int(sharded)}"] = state
    return {f"rng.{rank}.{k}": v for k, v in out.items()}


def _set_rng(loaded: Mapping[str, torch.Tensor], device: torch.device, tp_rng: Any = None) -> None:
    torch.set_rng_state(loaded["torch"])
    if tp_rng is not None:
        tp_rng.restore({(k.split("_")[1], k.split("_")[2] == "1"): v
                        for k, v in loaded.items() if k.startswith("tp_")})
    has_gauss, gauss = loaded["python_gauss"].tolist()
    random.setstate((3, tuple(loaded["python"].tolist()), gauss if has_gauss else None))
    pos, flag, cached = loaded["numpy_rest"].tolist()
    np.random.set_state(("MT19937", loaded["numpy_keys"].numpy().astype(np.uint32), int(pos), int(flag), cached))
    if device.type == "cuda" and "cuda" in loaded:
        torch.cuda.set_rng_state(loaded["cuda"], device)


_SCALER_FIELDS = SCALER_FIELDS  # checked in the manifest (checkpoint_manifest.py)


def _scaler_state(pm: "ParallelModel") -> dict | None:
    """fp16's dynamic loss scale (the same on every rank: overflow is all-reduced).
    ``growth_interval``/``min_scale`` are configuration, which the loading run decides."""
    scaler = pm.master.scaler if pm.master is not None else None
    return None if scaler is None else {f: getattr(scaler, f) for f in _SCALER_FIELDS}


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
    status: list[Any] = [None, None]
    if rank == 0:
        try:  # the job's lock on the directory, then its own temporary
            acquire(root)
            remove_debris(root)  # only killed saves' and prunes' leftovers: we hold the lock
            tmp = temporary(final)
            tmp.mkdir()
            status = [None, str(tmp)]
        except (CheckpointLockError, OSError) as exc:
            status = [exc, None]
    dist.broadcast_object_list(status, src=0)  # every rank fails alike, none waits in a barrier
    if status[0] is not None:
        raise status[0]
    tmp = Path(status[1])
    # DCP returns on every rank only after rank 0 wrote .metadata (its "finish" step).
    dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))
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


# ---- load ------------------------------------------------------------------------------------
def _check_model(program: Program, specs: Mapping[str, ShardSpec], saved: Mapping[str, Any], path: Path) -> None:
    """The checkpoint must hold exactly this model's tensors, by name and full shape
    (after the TP pass ``ParamInfo.shape`` is the local shape: ``full_shape`` from the spec)."""
    expected = full_shapes(program, specs)
    found = {k[len("model."):]: tuple(md.size) for k, md in saved.items() if k.startswith("model.")}
    raise_if_mismatched(
        f"checkpoint {path} does not match this model ({program.source})",
        sorted(set(expected) - set(found)), sorted(set(found) - set(expected)),
        [f"{n}: checkpoint {found[n]} vs model {expected[n]}"
         for n in sorted(set(expected) & set(found)) if tuple(found[n]) != tuple(expected[n])])


def _targets(saved: Mapping[str, Any], prefix: str) -> dict[str, torch.Tensor]:
    """Empty CPU tensors, shaped as DCP's index says, for every saved key under ``prefix``."""
    return {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for k, md in saved.items() if k.startswith(prefix) and hasattr(md, "size")}


def _local_targets(pm: "ParallelModel", saved: Mapping[str, Any], prefix: str, name_of: Any,
                   wanted: set[str]) -> dict[str, tuple[Any, Callable[[], torch.Tensor]]]:
    """Load targets for the saved keys under ``prefix`` whose parameter this rank
    holds, as (what DCP fills, a function returning this rank's tensor once filled): for
    a tensor-parallel parameter (and its moments, of the full shape) a ShardedTensor of
    this rank's ranges over a local-shape buffer, so no full tensor is ever built;
    otherwise one full tensor."""
    out = {}
    for key, md in saved.items():
        if not key.startswith(prefix) or name_of(key) not in wanted:
            continue
        spec, shape, dtype = pm.specs.get(name_of(key)), tuple(md.size), md.properties.dtype
        if is_sharded(spec) and shape == tuple(spec.full_shape):
            out[key] = empty_chunks(spec, pm.groups.tp_rank, _tp_ranks(pm), pm.groups.tp_group, dtype)
        else:
            full = torch.empty(shape, dtype=dtype)
            out[key] = (full, lambda full=full: full)
    return out


def _like(current: Any, loaded: torch.Tensor) -> Any:
    """A loaded hyper-parameter in the type the optimizer was built with."""
    if isinstance(current, torch.Tensor):
        return loaded.to(dtype=current.dtype, device=current.device)
    if isinstance(current, (tuple, list)):
        return type(current)(type(c)(x) for c, x in zip(current, loaded.tolist()))
    return type(current)(loaded.item())


def _install_optimizer(optimizer: torch.optim.Optimizer, names: list[str],
                       loaded: Mapping[str, torch.Tensor]) -> None:
    """Rebuild torch.optim's index-keyed state dict from name-keyed tensors and load it
    (torch's load_state_dict then casts state to each parameter's device and dtype)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    hyper: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in loaded.items():
        kind, rest = key[len("optim."):].split(".", 1)
        name, field = rest.rsplit(".", 1)  # torch.optim's own keys have no dots
        (state if kind == "state" else hyper).setdefault(name, {})[field] = t
    current = optimizer.state_dict()
    groups = []
    for group in current["param_groups"]:
        group = dict(group)
        for key, value in list(group.items()):
            found = [hyper[names[i]][key] for i in group["params"] if key in hyper.get(names[i], {})]
            if key != "params" and found and _is_number(value):
                group[key] = _like(value, found[0])
        groups.append(group)
    optimizer.load_state_dict({"state": {i: state[n] for i, n in enumerate(names) if n in state},
                               "param_groups": groups})


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
    status: list[Any] = [None, None, None]
    if rank == 0:
        try:
            acquire(directory)
            paths, notes = candidates(directory, step)
            status = [None, [str(p) for p in paths], notes]
        except (CheckpointLockError, FileNotFoundError) as exc:
            status = [exc, None, None]
    dist.broadcast_object_list(status, src=0)  # every rank fails alike, and tries the same paths
    if status[0] is not None:
        raise status[0]

    def shared_problems(path: Path) -> list[str]:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, local_problems(path, (rank, world)))
        return sorted({p for part in gathered for p in part})

    path, skipped = pick_intact([Path(p) for p in status[1]], shared_problems, strict=step is not None,
                                notes=status[2])
    if skipped and rank == 0:
        warnings.warn(f"resuming from {path}, skipping: " + "; ".join(skipped), CheckpointFallbackWarning,
                      stacklevel=3)
    meta = read_manifest(path)
    adopt_run(directory, meta.get("run"))  # this job continues that run: its saves prune its steps
    return path, meta


def read_dcp(tensors: dict[str, torch.Tensor], path: Path, *, no_dist: bool = False) -> None:
    """``dcp.load`` from ``path`` with the safe reader. DCP reports a failed read (a
    file changed after the digests were checked, or a format-1 checkpoint without
    digests) as ``CheckpointException``, which derives from BaseException, not
    Exception: turned into a ``CorruptCheckpointError`` naming the checkpoint. The
    failure is gathered by DCP, so every rank raises it alike."""
    try:
        dcp.load(tensors, storage_reader=SafeReader(path), no_dist=no_dist)
    except CheckpointException as exc:
        raise CorruptCheckpointError(f"checkpoint {path} could not be read: {str(exc)[:600]}") from None


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


# ---- export ----------------------------------------------------------------------------------
from fxpipe.checkpoint.export import export_consolidated  # noqa: E402  (re-exported: docs/checkpoints.md)
