"""``TrainConfig``: what ``fxpipe run`` trains — one ``ParallelConfig`` for the layout,
and what only a training job has (model, data, optimizer, evaluation, checkpoints,
reports). Imports nothing of the job, so every part of the job can read it."""
from __future__ import annotations

from dataclasses import dataclass, field

from fxpipe.base.enums import NamedEnum
from fxpipe.data.tokens import TokenDtype
from fxpipe.ir.parallel_config import ParallelConfig


class LRSchedule(NamedEnum, what="--lr-schedule"):
    """What the learning rate does after the linear warm-up."""
    CONSTANT = "constant"
    COSINE = "cosine"
    """Half a cosine from --lr to --min-lr over the steps after warm-up (Loshchilov &
    Hutter 2017, SGDR, without restarts; nanoGPT's and Megatron's default)."""
    LINEAR = "linear"
    """A straight line from --lr to --min-lr at the last step."""


def _default_layout() -> "ParallelConfig":
    return ParallelConfig(tp=2, pp=2, dp=1, microbatches=4)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """``fxpipe run``: the layout (one ``ParallelConfig``, as ``parallelize`` takes it)
    and what only a training job has — model, data, optimizer, evaluation, checkpoints,
    reports. Every field is a flag and a key of ``--config FILE.toml`` (``fxpipe/job/flags.py``)."""
    model: str = "gpt-small"
    """A registry name, ``package.module:function``, or a Hugging Face model directory
    (config.json, with or without safetensors: built on the meta device, each rank loading its shards)."""
    parallel: "ParallelConfig" = field(default_factory=_default_layout)
    world: int | None = None
    """Ranks to search the layout for (``fxpipe/job/layout_choice.py``): the layout fields
    given pin the search, the others are chosen. None: searched for the GPUs here (else
    4) when no layout field is given, else the layout as given (tp·pp·dp workers)."""
    micro_batch_size: int = 4
    """Sequences per microbatch b."""
    global_batch: int | None = None
    """Sequences per step; default micro_batch_size · microbatches · dp."""
    seq: int = 128
    """Tokens per sequence s (windows of s + 1 tokens: inputs and their next tokens)."""
    steps: int = 80
    """Optimizer steps; the LR schedule decays over them."""
    # ---- data (fxpipe/data) ----
    data: str | None = None
    """A token file (.bin, .npy), text (.txt, .jsonl, a directory of them), a Hugging Face dataset
    (save_to_disk directory, .parquet, .arrow); None: the standard library's source."""
    val_data: str | None = None
    """Validation data in the same forms; None: the last ``val_fraction`` of ``data``'s windows."""
    val_fraction: float | None = None
    """Share of the windows held out for validation; None: 0.05 when eval_interval is set, else 0."""
    tokenizer: str | None = None
    """tokenizer.json or a tokenizer directory for text; None: the model directory's when it has one, else bytes."""
    data_dtype: str = "uint16"
    """Element type of a .bin token file (the file does not say): uint16 or uint32."""
    text_column: str = "text"
    """A dataset's text column; a dataset without it is read from ``input_ids`` as token ids."""
    data_cache: str | None = None
    """Directory for token caches of text and datasets; None: beside the data."""
    # ---- optimizer ----
    lr: float = 2e-3
    """Peak AdamW learning rate (betas 0.9, 0.95)."""
    lr_schedule: str = "constant"
    """After warm-up: constant, cosine or linear decay to min_lr at the last step (``fxpipe/job/optimizer.py``)."""
    warmup: int = 5
    """Linear learning-rate warm-up steps."""
    min_lr: float = 0.0
    """The rate cosine and linear decay end at."""
    weight_decay: float = 0.1
    """AdamW's, on matrices and embeddings; biases and norm weights (1-D tensors) get none."""
    grad_clip: float | None = None
    """Clip the global gradient norm over every shard to this; None: no clipping."""
    # ---- evaluation and reports ----
    eval_interval: int = 0
    """Steps between validation passes (and after the last step); 0: none."""
    eval_steps: int = 4
    """Global batches per validation pass."""
    metrics_file: str | None = None
    """Append one JSON object per logged step (and per validation) to this file."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (needs the tensorboard package)."""
    peak_tflops: float | None = None
    """The device's peak dense TFLOP/s for MFU; None: known GPUs' table (``fxpipe/base/hardware.py``), else no MFU."""
    log_interval: int = 10
    """Steps between log lines (and metrics records); the first step is always logged."""
    timeline: str | None = "fxpipe-timeline"
    """Path prefix for the measured timeline of the last step (.json Perfetto, .png); None: off."""
    init_from: str | None = None
    """A Hugging Face safetensors directory to take the weights from (each rank reads its shards)."""
    checkpoint_dir: str | None = None
    """Directory of DCP checkpoints (docs/checkpoints.md); None: never save."""
    save_interval: int | None = None
    """Save every N steps when checkpoint_dir is set (always also at the end and on SIGTERM/SIGINT)."""
    resume: bool = False
    """Continue from the latest complete checkpoint in checkpoint_dir (model, optimizer, RNG, data position)."""
    overwrite: bool = False
    """Save into a checkpoint_dir that holds another run's checkpoints, replacing them at the
    first save (without it, and without resume, the launcher refuses such a directory)."""
    resume_from: int | None = None
    """Resume from the checkpoint of this step (implies ``resume``); an error if it is corrupt."""
    export: str | None = None
    """Write one consolidated state_dict under the model's own names here when the run completes."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept in checkpoint_dir; older ones are deleted after each save."""

    def __post_init__(self) -> None:
        if self.parallel.dp is None:  # fxpipe run starts tp·pp·dp workers: dp must be known
            raise ValueError("TrainConfig needs parallel.dp (the workers fxpipe run starts)")
        if self.checkpoint_dir is None and (self.resume or self.resume_from is not None
                                            or self.save_interval is not None):
            raise ValueError("--resume, --resume-from and --save-interval need --checkpoint-dir DIR")
        if self.resume_from is not None:
            if self.resume_from < 0:
                raise ValueError(f"--resume-from must be a step >= 0, got {self.resume_from}")
            object.__setattr__(self, "resume", True)
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"--save-interval must be >= 1, got {self.save_interval}")
        # Sizes first: the global-batch hint below divides by them.
        for name in ("micro_batch_size", "seq", "steps", "log_interval", "eval_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        layout = self.parallel
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"--global-batch must be >= 1, got {self.global_batch}")
        if self.global_batch is not None:
            per_step = self.micro_batch_size * layout.num_microbatches * layout.dp
            if self.global_batch != per_step:
                raise ValueError(
                    f"global batch {self.global_batch} != micro-batch size · microbatches · dp = "
                    f"{self.micro_batch_size}·{layout.num_microbatches}·{layout.dp} = {per_step}; "
                    f"{_batch_hint(self.global_batch, self.micro_batch_size, layout.dp)}")
        object.__setattr__(self, "lr_schedule", LRSchedule.parse(self.lr_schedule))
        object.__setattr__(self, "data_dtype", TokenDtype.parse(self.data_dtype))
        if self.val_fraction is None:
            object.__setattr__(self, "val_fraction", 0.05 if self.eval_interval and self.val_data is None else 0.0)
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.eval_interval and self.val_data is None and self.val_fraction == 0:
            raise ValueError("--eval-interval needs validation data: --val-data PATH or --val-fraction F > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr must be in [0, --lr {self.lr:g}], got {self.min_lr:g}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"--grad-clip must be a norm > 0, got {self.grad_clip}")
        if self.warmup < 0 or self.eval_interval < 0 or self.weight_decay < 0:
            raise ValueError(f"--warmup, --eval-interval and --weight-decay must be >= 0, got "
                             f"{self.warmup}, {self.eval_interval}, {self.weight_decay}")

    @property
    def world_size(self) -> int:
        return self.parallel.tp * self.parallel.pp * self.parallel.dp

    @property
    def batch(self) -> int:
        return self.micro_batch_size * self.parallel.num_microbatches * self.parallel.dp


def _batch_hint(global_batch: int, micro_batch_size: int, dp: int) -> str:
    """Flags that make b·m·dp equal ``global_batch`` (only values that do), or why none can."""
    if global_batch % dp:
        return f"--global-batch must be a multiple of --dp {dp}"
    per_replica = global_batch // dp
    if per_replica % micro_batch_size == 0:
        return f"set --microbatches {per_replica // micro_batch_size}"
    b = max(d for d in range(1, micro_batch_size) if per_replica % d == 0)
    return f"set --micro-batch-size {b} --microbatches {per_replica // b}"
