"""What ``fxpipe run`` checks in the launcher, before any worker process starts.

A bad flag found by a worker costs seconds of start-up per rank and prints one
traceback per rank, and another rank's "connection closed" can hide the cause. So
the launcher checks, in order of cost, and stops at the first problem with one
message that says what is wrong, the numbers involved and how to fix it:

1. flags alone: numbers (``--timeout``, ``--lr``, ``--seed``), names (partition method,
   schedule), ``--sp`` constraints, the sequence length against a registry GPT, the
   schedule's size, tp·pp·dp against the workers this machine can start;
2. the file system (``fxpipe/job/preflight_files.py``): ``--checkpoint-dir`` (writable by a
   probe write, its lock free, no other run's checkpoints without ``--resume`` or
   ``--overwrite``, the checkpoint a resume takes verified), ``--export`` and
   ``--timeline`` (a file we can create), ``--init-from``'s files;
3. the model, captured once here exactly as each worker will (one microbatch; on
   the meta device for registry GPTs above ~300M parameters, so no weights are
   allocated): its name, the tensor-parallel analysis (tp against attention heads,
   sequence parallelism against the sequence length), a non-ILP partition, token ids
   of the data against the vocabulary (``fxpipe/ir/token_inputs.py``), ``--resume`` against
   the checkpoint's ``fxpipe.json`` (the same tensors, an LR schedule ``--lr``
   continues) and ``--init-from``'s names, shapes and dtypes.

Every check raises :class:`PreflightError` (a ``ValueError``: the CLI prints it
without a traceback and exits 2, as argparse does for a bad flag).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from fxpipe.base.local_workers import GIB_PER_WORKER, WORKERS_PER_CORE, local_worker_limit
from fxpipe.checkpoint.lock import CheckpointLockError, check_free
from fxpipe.compiler.pipeline import compile_pipeline
from fxpipe.costs import CostProfile, ProfileError, probe_groups
from fxpipe.costs.profile import check_plausible
from fxpipe.ir.artifact import CompiledPipeline
from fxpipe.ir.parallel_config import ParallelConfig, check_layout
from fxpipe.ir.program import Program
from fxpipe.ir.token_inputs import TokenRole
from fxpipe.job.config import TrainConfig
from fxpipe.job.flags import LAYOUT_FLAGS
from fxpipe.job.output_paths import check_outputs
from fxpipe.job.preflight_data import DataFacts, check_data, check_position
from fxpipe.job.preflight_files import (PreflightError, check_owner, check_resume, check_weights, check_writable_dir,
                                        check_writable_file, resume_path)
from fxpipe.job.preflight_sizes import check_shape, check_state_bound, state_room
from fxpipe.job.prepare import job_workload, weights_dir
from fxpipe.models.hf_dir import is_model_dir, load_config
from fxpipe.models.registry import GPT_CONFIGS, build_device
from fxpipe.params.hf_weights import WeightsDir
from fxpipe.partition import Method, PartitionError
from fxpipe.passes.causality import attention_is_causal
from fxpipe.schedules.registry import check_size, generate, get_spec
from fxpipe.runtime.launch import launched_world, local_world_size, under_torchrun

def check_run(config: "TrainConfig", *, model: bool = True,
              config_file: str | None = None) -> "CompiledPipeline | None":
    """The file-system and model checks, cheapest first (``check_flags`` runs on the flags,
    before the config exists); ``model=False`` skips capturing the model. Returns what
    the model check compiled (tensor-parallel, costed), or None."""

    resume = check_paths(config, config_file)
    shape = check_shape(config.model)  # sizes from the config alone, before data, search or capture
    check_state_bound(config.model, shape, _ranks(config))
    data = check_data(config)
    if resume is not None:  # the checkpoint's data position against this run's data
        check_position(resume, config, data)
    return check_model(config, resume, data) if model else None


def _ranks(config: "TrainConfig") -> int:
    """The most ranks the run may spread its state over (the searched world, the layout
    given, torchrun's world, the GPUs here): the state bound must never overestimate."""
    import torch

    layout = config.parallel
    return max(config.world or 1, layout.tp * layout.pp * layout.dp, launched_world() or 1,
               torch.cuda.device_count())


# ---- 1. flags --------------------------------------------------------------------------------
def check_flags(values: Mapping[str, Any]) -> None:
    """``fxpipe run``'s settings by field name (the defaults, the config file and the
    flags merged; enums by their names), checked so that every message says which flag
    to change: the layout by the rules ``ParallelConfig`` checks its fields with
    (``check_layout``), then what only a run has."""

    v = values
    layout = {f.field: v[f.field] for f in LAYOUT_FLAGS.values() if f.field in v}
    try:  # the layout's own rules (ir/parallel_config.py), messages naming the flags
        check_layout(layout, flag=lambda field: LAYOUT_FLAGS[field].option)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    if not 0 <= v["seed"] < 2**63:  # torch, numpy and the data order all take it
        raise PreflightError(f"--seed must be in [0, 2**63), got {v['seed']}")
    world = v.get("world")
    check_world(world if world is not None else v["tp"] * v["pp"] * v["dp"])
    peak = v.get("peak_tflops")
    if peak is not None and not MIN_PEAK_TFLOPS <= peak <= MAX_PEAK_TFLOPS:  # 1e-300 printed a 300-digit MFU
        raise PreflightError(f"--peak-tflops must be a device's peak in [{MIN_PEAK_TFLOPS:g}, {MAX_PEAK_TFLOPS:g}] "
                             f"TFLOP/s, got {peak:g}; e.g. 989 for an H100's bf16, or leave it out")
    if not math.isfinite(v["lr"]) or v["lr"] <= 0:
        raise PreflightError(f"--lr must be a positive finite number, got {v['lr']} (default 2e-3)")
    if v["costs"] not in ("measure", "model"):
        try:
            CostProfile.load(v["costs"])
        except ProfileError as e:
            raise PreflightError(f"--costs {v['costs']}: {e}; use --costs measure (times the graph on "
                                 f"the workers and caches it) or --costs model") from None
    model, seq, tp = v["model"], v["seq"], v["tp"]
    if v["sp"] and seq % tp:
        raise PreflightError(f"--sp splits the sequence over tp={tp} ranks: --seq {seq} "
                             f"is not a multiple of {tp}; use --seq {seq - seq % tp or tp}")
    cfg = GPT_CONFIGS.get(model)
    if cfg is not None and seq > cfg.block_size:
        raise PreflightError(f"--seq {seq} exceeds {model}'s block size {cfg.block_size}")
    if is_model_dir(model):
        positions = getattr(load_config(model).get_text_config(), "max_position_embeddings", None)
        if isinstance(positions, int) and seq > positions:
            raise PreflightError(f"--seq {seq} exceeds the {positions} positions of {model} "
                                 f"(max_position_embeddings in its config.json); use --seq <= {positions}")
    try:
        spec = get_spec(v["schedule"])
        chunks = v["chunks"] if v["chunks"] is not None else spec.default_chunks
        check_size(v["pp"], v["num_microbatches"], chunks)  # generating it must fit in memory
        generate(v["schedule"], v["pp"], v["num_microbatches"], chunks)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


MIN_PEAK_TFLOPS, MAX_PEAK_TFLOPS = 1e-3, 1e5
"""A device's peak dense TFLOP/s: from a slow CPU core (~0.01) to beyond any accelerator (B200: ~2,250)."""


def check_world(world: int) -> None:
    """tp·pp·dp local workers must be startable here (launched by fxpipe, not torchrun,
    which places processes on nodes itself): one GPU each on a GPU machine, else within
    WORKERS_PER_CORE per core and the free memory at GIB_PER_WORKER each."""
    if under_torchrun():
        return
    import torch

    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if world > gpus:
            raise PreflightError(f"tp·pp·dp = {world} workers, but this machine has {gpus} GPUs (one "
                                 f"worker each); use at most {gpus}, or start the job across nodes with torchrun")
        return
    limit, cores, free_gib = local_worker_limit()
    if world > limit:
        raise PreflightError(
            f"tp·pp·dp = {world} worker processes, but this machine can start at most {limit} ({cores} CPU "
            f"cores × {WORKERS_PER_CORE}, {free_gib:.1f} GiB free at {GIB_PER_WORKER} GiB each); "
            f"use tp·pp·dp <= {limit}, or start the job across nodes with torchrun")


# ---- 2. the file system (fxpipe/job/preflight_files.py) -----------------------------------------
def check_paths(config: "TrainConfig", config_file: str | None = None) -> Path | None:
    """Returns the checkpoint a resume will start from (digests verified), else None."""
    check_outputs(config, config_file)  # no output on an input or through a link (fxpipe/job/output_paths.py)
    resume = None
    if config.init_from is not None:
        try:  # the files alone (names, shapes and dtypes against the model: ``check_model``)
            WeightsDir(config.init_from)
        except (OSError, ValueError) as exc:
            raise PreflightError(f"--init-from: {exc}") from None
    if config.checkpoint_dir is not None:
        ckpt = Path(config.checkpoint_dir)
        check_writable_dir(ckpt, "--checkpoint-dir", "choose a directory that this user can write")
        if ckpt.is_dir():
            try:  # another job writing there would race this one's saves
                check_free(ckpt)
            except CheckpointLockError as exc:
                raise PreflightError(str(exc)) from None
        check_owner(config)
        if config.resume:
            resume = resume_path(config)  # raises naming what is missing or damaged
    if config.export is not None:
        export = Path(config.export)
        if export.is_dir() or export.suffix == "":  # a safetensors directory (fxpipe/checkpoint/export.py)
            check_writable_dir(export, "--export", "choose a directory that this user can write")
        else:
            check_writable_file(export, "--export")
    if config.timeline is not None:
        check_writable_file(Path(config.timeline + ".json"), "--timeline")
    if config.metrics_file is not None:
        check_writable_file(Path(config.metrics_file), "--metrics-file")
    if config.tensorboard_dir is not None:
        import importlib.util
        if importlib.util.find_spec("tensorboard") is None:
            raise PreflightError("--tensorboard-dir needs the tensorboard package: pip install tensorboard "
                                 "(or leave it out: --metrics-file writes the same scalars as JSON lines)")
        check_writable_dir(Path(config.tensorboard_dir), "--tensorboard-dir", "choose a directory that this user can write")
    return resume


# ---- 3. the model ----------------------------------------------------------------------------
def check_model(config: "TrainConfig", resume: Path | None = None, data: "DataFacts | None" = None) -> "CompiledPipeline":
    """Capture and compile the model as the workers will, through the cheap passes (a
    non-ILP partition too; the ILP and measured costs are left to the workers)."""
    import torch

    if data is None:
        data = check_data(config)
    device = build_device(config.model)  # where job_workload builds it
    w = _workload(config)
    if w.vocab_size is not None:
        _check_vocab(config.model, w.vocab_size, "the rows of its embedding", data)
    # The batch the workers build from the data's windows, with its largest id as every
    # id. It is built on the CPU (ids are checked there: a meta tensor has no values)
    # and only then moved to the capture device.
    tokens = torch.full((config.micro_batch_size, config.seq + 1), data.largest_id, dtype=torch.long)
    cpu_example = w.batch_from_tokens(tokens)
    example = tuple(t.to(device) for t in cpu_example)
    layout = config.parallel
    heuristic = layout.partition is not Method.ILP
    try:
        result = compile_pipeline(w.model, example, layout, loss_fn=w.loss_fn,
                                  until="partition" if heuristic else "cost")
    except PartitionError as exc:
        raise PreflightError(f"--partition {layout.partition.value}: {exc}") from None
    check_state_fits(result.program, layout)
    if layout.costs not in ("measure", "model"):  # a profile's numbers, before any worker applies them
        check_profile_numbers(result.program, layout)
    if attention_is_causal(result.program) is False:  # next-token targets would be in the inputs
        raise PreflightError(f"--model {config.model}: its attention lets a position see later ones (a bidirectional "
                             f"encoder, such as BERT without \"is_decoder\": true); fxpipe run trains next-token "
                             f"prediction, whose targets such a model reads in its inputs: use a causal (decoder) "
                             f"model, or set \"is_decoder\": true in config.json where the family has it")
    for t in result.program.token_inputs:
        role = "embedding" if t.role is TokenRole.EMBEDDING else "loss (the logits' classes)"
        _check_vocab(config.model, t.vocab_size, f"the rows of its {role} at {t.module or t.node}", data)
    if config.resume:
        check_resume(result.program, resume or resume_path(config), config)

    try:
        weights = weights_dir(config)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    if weights is not None:  # --init-from, or the --model directory's own safetensors
        check_weights(result.program, weights)
    return result


def check_profile_numbers(program: Program, layout: ParallelConfig) -> None:
    """A cost profile's times against this graph's own cost model (``costs/profile.py``'s
    ``check_plausible``), where the profile has this graph's groups (which graph it was
    measured for is checked by the workers, who know their place in the mesh)."""
    _, probe = probe_groups(program, layout.partition_config(layout.schedule_ir()))
    profile = CostProfile.load(layout.costs)
    if len(profile.groups) == len(probe.members):
        try:
            check_plausible(profile, probe, f"--costs {layout.costs}")
        except ProfileError as exc:
            raise PreflightError(str(exc)) from None


def check_state_fits(program: Program, layout: ParallelConfig) -> None:
    """The model's training state — parameters, gradients and Adam's moments, at least;
    activations come on top — against the memory it will have, before any worker
    allocates it: on GPUs each rank's share (1/(tp·pp) of the model) against one
    device's memory; on this machine's CPUs every local rank's (the model once per
    data-parallel replica) against the memory free now. Under torchrun every node runs
    its own preflight on its own ranks' share."""
    stats = program.model_stats
    params = stats.num_parameters if stats is not None else program.num_parameters()
    per_param = 4 * layout.state_bytes_per_param_byte  # fp32 masters and their state
    # Each rank holds 1/(tp·pp) of the model; every data-parallel replica holds it all.
    need, have, where = state_room(params * per_param, layout.tp * layout.pp,
                                   layout.tp * layout.pp * layout.replicas)
    if need > have:
        raise PreflightError(f"the model's {params:,} parameters need {need / 2**30:.1f} GiB of training state "
                             f"({per_param:g} bytes each: fp32 weights, gradients and Adam's moments"
                             f"{', ZeRO-1' if layout.zero else ''}; activations on top), more than {where}: use a "
                             f"smaller model, more ranks (tp·pp shard the state), --zero 1 with data parallelism, or "
                             f"more machines")


def _check_vocab(model: str, vocab: int, where: str, data: "DataFacts") -> None:
    """The tokenizer's vocabulary, then the data's largest id, against the model's
    (never clamped: an id past the vocabulary trains on other tokens)."""
    if data.tokenizer_vocab is not None and data.tokenizer_vocab > vocab:
        raise PreflightError(f"{model} has a vocabulary of {vocab} tokens ({where}), but the tokenizer of "
                             f"{data.source} has {data.tokenizer_vocab}: its largest id is "
                             f"{data.tokenizer_vocab - 1}; give the model a vocabulary of at least "
                             f"{data.tokenizer_vocab}, or use the model's own tokenizer")
    if data.largest_id >= vocab:
        raise PreflightError(f"{model} has a vocabulary of {vocab} tokens ({where}), but the largest token id "
                             f"in {data.source} is {data.largest_id}; give the model a vocabulary of at least "
                             f"{data.largest_id + 1}, or re-tokenize the data with the model's tokenizer")


def _workload(config: "TrainConfig"):
    """``job_workload`` with one microbatch, with a user function's own failure (any exception, or a result
    that is not a workload) reported as one line naming it."""

    try:
        return job_workload(config, batch=config.micro_batch_size)
    except (ValueError, TypeError) as exc:
        raise PreflightError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001  (a user model function's own failure, reported as theirs)
        raise PreflightError(f"--model {config.model} raised {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:300]}") from None
