"""What ``fxpipe run`` checks in the launcher, before any worker process starts.

A bad flag found by a worker costs seconds of start-up per rank and prints one
traceback per rank, and another rank's "connection closed" can hide the cause. So
the launcher checks, in order of cost, and stops at the first problem with one
message that says what is wrong, the numbers involved and how to fix it:

1. flags alone: numbers (``--timeout``, ``--lr``), names (partition method,
   schedule), ``--sp`` constraints, the sequence length against a registry GPT;
2. the file system: ``--checkpoint-dir`` (a directory we can write, or can create),
   ``--export`` and ``--timeline`` (a file we can create);
3. the model, captured once here exactly as each worker will (one microbatch; on
   the meta device for registry GPTs above ~300M parameters, so no weights are
   allocated): its name, the tensor-parallel analysis (tp against attention heads,
   sequence parallelism against the sequence length), a non-ILP partition, token ids
   of the data against the vocabulary (``fxpipe/vocab.py``), and ``--resume`` against
   the checkpoint's ``fxpipe.json`` (it must come from a model with the same tensors).

Every check raises :class:`PreflightError` (a ``ValueError``: the CLI prints it
without a traceback and exits 2, as argparse does for a bad flag).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxpipe.compiler import CompileResult
    from fxpipe.program import Program
    from fxpipe.train import TrainConfig

DATA_VOCAB = 256
"""``fxpipe run`` trains on bytes (``fxpipe/data.py``): ids 0..255."""
META_ABOVE_PARAMS = 3e8
"""Registry GPTs larger than this are captured on the meta device."""


class PreflightError(ValueError):
    """A problem found before spawning workers; the message is the whole report."""


def check_run(config: "TrainConfig", *, model: bool = True) -> "CompileResult | None":
    """The file-system and model checks, cheapest first (``check_flags`` runs on the flags,
    before the config exists); ``model=False`` skips capturing the model. Returns what
    the model check compiled (tensor-parallel, costed), or None."""
    check_paths(config)
    return check_model(config) if model else None


# ---- 1. flags --------------------------------------------------------------------------------
def check_flags(args: Any) -> None:
    """``fxpipe run``'s flags (an argparse namespace) checked by name, so every message
    says which flag to change; ``ParallelConfig`` would refuse the same values by field."""
    from fxpipe.models.registry import GPT_CONFIGS
    from fxpipe.partition import Method
    from fxpipe.schedules.registry import generate, get_spec

    for name in ("tp", "pp", "dp", "microbatches"):
        if getattr(args, name) < 1:
            raise PreflightError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise PreflightError(f"--timeout must be a positive number of seconds, got {args.timeout}; "
                             f"it bounds every transfer and collective (default 60)")
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise PreflightError(f"--lr must be a positive finite number, got {args.lr} (default 2e-3)")
    methods = [m.value for m in Method]
    if args.partition not in methods:
        raise PreflightError(f"unknown --partition {args.partition!r}; valid: {', '.join(methods)}")
    if args.costs not in ("measure", "model"):
        from fxpipe.costs import CostProfile, ProfileError
        try:
            CostProfile.load(args.costs)
        except ProfileError as e:
            raise PreflightError(f"--costs {args.costs}: {e}; use --costs measure (times the graph on "
                                 f"the workers and caches it) or --costs model") from None
    if args.sp and args.tp == 1:
        raise PreflightError("--sp needs --tp > 1: sequence parallelism splits the sequence over "
                             "the tensor-parallel group")
    if args.sp and args.seq % args.tp:
        raise PreflightError(f"--sp splits the sequence over tp={args.tp} ranks: --seq {args.seq} "
                             f"is not a multiple of {args.tp}; use --seq "
                             f"{args.seq - args.seq % args.tp or args.tp}")
    cfg = GPT_CONFIGS.get(args.model)
    if cfg is not None and args.seq > cfg.block_size:
        raise PreflightError(f"--seq {args.seq} exceeds {args.model}'s block size {cfg.block_size}")
    try:
        spec = get_spec(args.schedule)
        generate(args.schedule, args.pp, args.microbatches,
                 args.chunks if args.chunks is not None else spec.default_chunks)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


# ---- 2. the file system ----------------------------------------------------------------------
def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable_dir(path: Path, flag: str, what: str) -> None:
    """``path`` is (or can be created as) a directory this process can write into."""
    base = _nearest_existing(path)
    if base == path.absolute() and not path.is_dir():
        raise PreflightError(f"{flag} {path} is a file, not a directory; {what}")
    if not base.is_dir():
        raise PreflightError(f"{flag} {path} cannot be created: {base} is a file; {what}")
    if not os.access(base, os.W_OK | os.X_OK):
        verb = "is not writable" if base == path.absolute() else f"cannot be created ({base} is not writable)"
        raise PreflightError(f"{flag} {path} {verb}; {what}")


def _check_writable_file(path: Path, flag: str) -> None:
    """A file can be created (or replaced) at ``path``; its directory must exist."""
    if path.is_dir():
        raise PreflightError(f"{flag} {path} is a directory; give a file path")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise PreflightError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PreflightError(f"{flag} {path} cannot be written (no write permission in {parent})")


def latest_checkpoint_of(directory: str | None) -> Path | None:
    from fxpipe.runtime import checkpoint_files

    return checkpoint_files.latest_checkpoint(directory) if directory is not None else None


def _resume_path(config: "TrainConfig") -> Path | None:
    """The checkpoint a resume starts from: that of --resume-from, or the newest."""
    from fxpipe.runtime import checkpoint_files

    if config.resume_from is None:
        return latest_checkpoint_of(config.checkpoint_dir)
    path = Path(config.checkpoint_dir) / checkpoint_files.step_dirname(config.resume_from)
    return path if checkpoint_files.is_complete(path) else None


def check_paths(config: "TrainConfig") -> None:
    if config.init_from is not None:
        from fxpipe.weights import WeightsDir
        try:  # names and shapes are checked against the model by the workers, before any step
            WeightsDir(config.init_from)
        except (OSError, ValueError) as exc:
            raise PreflightError(f"--init-from: {exc}") from None
    if config.checkpoint_dir is not None:
        _check_writable_dir(Path(config.checkpoint_dir), "--checkpoint-dir",
                            "choose a directory that this user can write")
    if config.checkpoint_dir is not None and Path(config.checkpoint_dir).is_dir():
        from fxpipe.runtime.checkpoint_lock import CheckpointLockError, check_free
        try:  # another job writing there would race this one's saves
            check_free(config.checkpoint_dir)
        except CheckpointLockError as exc:
            raise PreflightError(str(exc)) from None
    if config.resume and _resume_path(config) is None:
        which = "no complete checkpoint" if config.resume_from is None else \
            f"no complete checkpoint of step {config.resume_from}"
        raise PreflightError(f"--resume: {which} in {config.checkpoint_dir}; drop --resume to start "
                             f"from step 0")
    if config.export is not None:
        export = Path(config.export)
        if export.is_dir() or export.suffix == "":  # a safetensors directory (fxpipe/runtime/export.py)
            _check_writable_dir(export, "--export", "choose a directory that this user can write")
        else:
            _check_writable_file(export, "--export")
    if config.timeline is not None:
        _check_writable_file(Path(config.timeline + ".json"), "--timeline")


# ---- 3. the model ----------------------------------------------------------------------------
def capture_device(model: str) -> str:
    """Meta (no weights allocated) for registry GPTs above ~300M parameters, else cpu."""
    from fxpipe.models.registry import GPT_CONFIGS

    cfg = GPT_CONFIGS.get(model)
    return "meta" if cfg is not None and cfg.num_params > META_ABOVE_PARAMS else "cpu"


def check_model(config: "TrainConfig") -> "CompileResult":
    """Capture and compile the model as the workers will, through the cheap passes (a
    non-ILP partition too; the ILP and measured costs are left to the workers)."""
    import torch

    from fxpipe.compiler import compile_pipeline
    from fxpipe.models.registry import build_workload
    from fxpipe.partition import Method, PartitionError
    from fxpipe.vocab import TokenRole

    device = capture_device(config.model)
    w = build_workload(config.model, batch=config.micro_batch_size, seq=config.seq, device=device,
                       seed=config.parallel.seed)
    # The batch the workers build from byte windows: the largest byte is the largest id
    # (a registry workload maps ids into its vocabulary itself: ``batch_from_tokens``).
    tokens = torch.full((config.micro_batch_size, config.seq + 1), DATA_VOCAB - 1, dtype=torch.long)
    example = tuple(t.to(device) for t in w.batch_from_tokens(tokens))
    layout = config.parallel
    heuristic = layout.partition is not Method.ILP
    try:
        result = compile_pipeline(w.model, example, layout, loss_fn=w.loss_fn,
                                  until="partition" if heuristic else "cost")
    except PartitionError as exc:
        raise PreflightError(f"--partition {layout.partition.value}: {exc}") from None
    for t in result.token_inputs:
        if int(example[t.input_index].max()) >= t.vocab_size:
            role = "embedding" if t.role is TokenRole.EMBEDDING else "loss (the logits' classes)"
            raise PreflightError(
                f"{config.model} has a vocabulary of {t.vocab_size} tokens (the rows of its {role} "
                f"at {t.module or t.node}), but fxpipe run trains on bytes, ids 0..{DATA_VOCAB - 1}; "
                f"give the model a vocabulary of at least {DATA_VOCAB}")
    if config.resume:
        check_resume(result.program, _resume_path(config))
    return result


def _show(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_resume(program: "Program", path: Path | None) -> None:
    """The checkpoint to resume from must hold this model's tensors (by ``state_dict``
    name); shapes are checked by the workers against DCP's index when they load."""
    from fxpipe.runtime.checkpoint import state_dict_names
    from fxpipe.runtime.checkpoint_manifest import CorruptCheckpointError, read_manifest

    if path is None:
        raise PreflightError("--resume: no complete checkpoint; drop --resume to start from step 0")
    try:
        meta: Any = read_manifest(path)  # type-checked
        saved = set(meta["state_dict"])
        source = meta["source"]
    except CorruptCheckpointError as exc:
        raise PreflightError(f"--resume: {exc}") from None
    ours = set(state_dict_names(program))
    missing, unexpected = sorted(ours - saved), sorted(saved - ours)
    if missing or unexpected:
        raise PreflightError(
            f"--resume: {path} was saved from another model ({source}, {len(saved)} tensors); "
            f"this model ({program.source}) has {len(ours)}: missing from the checkpoint: "
            f"{_show(missing) or 'none'}; not in this model: {_show(unexpected) or 'none'}. "
            f"Use the --model that saved it, or another --checkpoint-dir")
