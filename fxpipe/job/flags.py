"""Flags generated from the config dataclasses: one entry per field, shared by
``fxpipe compile`` and ``fxpipe run`` (and the keys of ``--config FILE.toml``).

As torchtitan derives its command line from its config classes, each field of
``ParallelConfig`` and of ``TrainConfig`` (and of ``compile``'s ``CompileTarget``)
has exactly one ``Flag`` here: its flag name, value type and help text. Its default
is never written here: it is the field's value in the command's default config (so
``--help`` shows what the dataclass holds), and a flag left out does not override the
config file or the dataclass. ``tests/cli/test_flags.py`` builds both parsers and
checks that every field has one flag and that the shared ones are identical.
"""
from __future__ import annotations

import argparse
import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping


class Kind(enum.Enum):
    """How a flag takes its value."""
    VALUE = "value"
    """``--name VALUE`` parsed by ``type``."""
    SWITCH = "switch"
    """``--name`` sets the field True (a bool field defaulting to False)."""
    NEGATED = "negated"
    """``--no-name`` sets the field False (a field whose default is True or derived)."""


def _number(text: str, cast: Callable[[str], Any], ok: Callable[[Any], bool], expected: str, must: str) -> Any:
    """``text`` parsed by ``cast`` and checked by ``ok``; argparse's error says what was
    expected (not a number) or what it must be (out of range)."""
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {must}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a size or count of zero is never meant)."""
    return _number(text, int, lambda v: v >= 1, "an integer >= 1", ">= 1")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, lambda v: math.isfinite(v) and v > 0, "a number > 0", "a finite number > 0")


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    return _number(text, float, lambda v: v >= 0, "a number", ">= 0")


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    return _number(text, float, lambda v: 0 <= v < 1, "a number in [0, 1)", "in [0, 1)")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (0: off)."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0", ">= 0")


@dataclass(frozen=True)
class Flag:
    field: str
    help: str
    type: Callable[[str], Any] | None = str
    kind: Kind = Kind.VALUE
    choices: tuple | None = None
    metavar: str | None = None
    name: str | None = None
    """The flag without dashes when it is not the field's name with '-' for '_'."""

    @property
    def option(self) -> str:
        return "--" + (self.name or self.field.replace("_", "-"))

    @property
    def key(self) -> str:
        """The TOML key: the flag's own name."""
        return self.option[2:]


def _flags(*flags: Flag) -> dict[str, Flag]:
    return {f.field: f for f in flags}


LAYOUT_FLAGS = _flags(
    Flag("tp", "tensor-parallel size t: ranks that split every sharded layer", positive_int),
    Flag("pp", "pipeline-parallel size p: ranks in one pipeline", positive_int),
    Flag("dp", "data-parallel replicas (compile: the layout's; run: workers = tp·pp·dp)", positive_int),
    Flag("num_microbatches", "microbatches per step m", positive_int, name="microbatches"),
    Flag("schedule", "gpipe, 1f1b, interleaved, zb-h1, zb-v"),
    Flag("chunks", "stages per pipeline rank v (default: the schedule's own)", positive_int),
    Flag("partition", "stage assignment: ilp, uniform, params, dp"),
    Flag("memory_limit_gb", "per-rank memory limit in GiB; every method must meet it, only ilp and dp "
         "take it into account", positive_float, metavar="GIB", name="memory-limit"),
    Flag("precision", "fp32; bf16; fp16 with dynamic loss scaling (16-bit modes keep fp32 master weights)",
         choices=("fp32", "bf16", "fp16")),
    Flag("recompute", "activation recomputation: selective = attention core, full = whole layer",
         choices=("none", "selective", "full")),
    Flag("sp", "sequence parallelism (with --tp > 1)", None, Kind.SWITCH),
    Flag("scatter_gather", "send full activations between stages instead of 1/t chunks (SC21 §4.1; "
         "default: scatter-gather when tp > 1 without --sp)",
         None, Kind.NEGATED),
    Flag("strict_tp", "fail when tensor parallelism leaves weight matrices whole on every rank",
         None, Kind.SWITCH),
    Flag("zero", "1: ZeRO stage 1 - shard optimizer state and fp32 masters over the --dp replicas "
         "(gradients reduced to each tensor's owner, parameters broadcast)", int, choices=(0, 1)),
    Flag("bucket_mb", "MB of gradients per data-parallel bucket, each reduced during the last backward "
         "as soon as it is final (0: one reduction after the backward)", non_negative_float, metavar="MB"),
    Flag("ep", "expert parallelism: each grouped MoE's experts owned by EP consecutive --dp ranks (E/EP "
         "each), tokens exchanged by all-to-all; must divide dp (with tp=1; not with --zero, --inductor, --recompute)",
         positive_int, metavar="EP"),
    Flag("costs", "what the partition balances: forward/backward times of the graph measured on this "
         "machine's ranks (cached on disk; compile measures in its own process and falls back to the "
         "--hardware model where it cannot: tp > 1, or no weights), the --hardware model's estimate, or "
         "a saved cost profile", metavar="measure|model|PATH"),
    Flag("split_loss", "compute the cross-entropy over a split LM head block by block, spread with its "
         "blocks over the stages (docs/costs.md)", None, Kind.SWITCH),
    Flag("vocab_passes", "run the LM head and its cross-entropy as vocabulary passes: each pipeline rank "
         "owns a block of the head's rows (of its TP shard under tp > 1; pp >= 2; docs/schedules.md)", None, Kind.SWITCH),
    Flag("seed", "model init, dropout and data order seed", int),
    Flag("timeout_s", "seconds before a collective or p2p transfer gives up", float, name="timeout"),
    Flag("inductor", "compile each pipeline stage with AOTAutograd + TorchInductor before the first step "
         "(C++ kernels on CPU, Triton on GPU; a stage that cannot be compiled runs eagerly with a warning; "
         "Inductor's disk cache is reused)", None, Kind.SWITCH),
    Flag("hardware", "cost model preset: cpu, a100"),
    Flag("time_limit_s", "ILP time limit, s", positive_float, name="time-limit"),
    Flag("allow_over_limit", "print a uniform/params plan that exceeds --memory-limit instead of refusing "
         "it (to compare methods)", None, Kind.SWITCH),
)
"""``ParallelConfig``'s fields (fxpipe/ir/parallel_config.py)."""


def optional_path(text: str) -> str | None:
    """argparse type: a path, or 'none' for no file."""
    return None if text.lower() == "none" else text


TRAIN_FLAGS = _flags(
    Flag("model", "registry name (gpt-tiny, gpt-small, gpt2-small, gpt2-medium, gpt3-175b, hf:gpt2, hf:llama, "
         "hf:gpt_neox, hf:opt), package.module:function returning (model, batch[, loss_fn]), or a Hugging "
         "Face model directory (config.json, with or without safetensors)", metavar="NAME|DIR"),
    Flag("world", "ranks to choose the layout for: tp, pp, dp, microbatches, schedule, chunks and vocabulary "
         "passes are searched (docs/layout_search.md), the layout flags given pin the search (default: searched "
         "for the GPUs here, else 4 ranks, when no layout flag is given)", positive_int),
    Flag("micro_batch_size", "sequences per microbatch b", positive_int),
    Flag("global_batch", "sequences per step; must equal b·m·dp (default: b·m·dp)", positive_int),
    Flag("seq", "sequence length s", positive_int),
    Flag("steps", "training steps", positive_int),
    Flag("data", "training data: a token file (.bin uint16/uint32, .npy), text (.txt, .jsonl with a "
         "'text' field), a directory of text, or a Hugging Face dataset (a save_to_disk directory, .parquet or "
         ".arrow files) (default: the Python standard library's source as bytes)", metavar="PATH"),
    Flag("text_column", "a dataset's column of text (default: text; a dataset without it is read from its "
         "input_ids column as token ids)", metavar="NAME"),
    Flag("data_cache", "directory for the token caches of text and datasets (default: beside the data); "
         "fxpipe prepare-data fills it ahead of a run", metavar="DIR"),
    Flag("val_data", "validation data in the same forms (default: the last --val-fraction of --data)",
         metavar="PATH"),
    Flag("val_fraction", "share of the data's windows held out for validation (default: 0.05 with "
         "--eval-interval, else 0)", fraction, metavar="F"),
    Flag("tokenizer", "tokenizer for text data: a tokenizer.json or a Hugging Face tokenizer directory "
         "(default: the --model directory's, else bytes)", metavar="PATH"),
    Flag("data_dtype", "element type of a .bin token file", choices=("uint16", "uint32")),
    Flag("lr", "peak AdamW learning rate", float),
    Flag("lr_schedule", "after warm-up: constant, cosine or linear decay to --min-lr",
         choices=("constant", "cosine", "linear")),
    Flag("warmup", "linear learning-rate warm-up steps", non_negative_int),
    Flag("min_lr", "learning rate at the last step of cosine or linear decay", float),
    Flag("weight_decay", "AdamW weight decay on matrices and embeddings (biases and norm weights: none)", float),
    Flag("grad_clip", "clip the global gradient norm over all tp/pp/dp shards to this (default: no clipping)",
         positive_float, metavar="NORM"),
    Flag("eval_interval", "steps between validation passes printing loss and perplexity (0: none)",
         non_negative_int, metavar="N"),
    Flag("eval_steps", "global batches per validation pass", positive_int, metavar="N"),
    Flag("metrics_file", "append one JSON object per logged step and validation to this file",
         metavar="FILE"),
    Flag("tensorboard_dir", "write TensorBoard scalars here (needs the tensorboard package)", metavar="DIR"),
    Flag("peak_tflops", "the device's peak dense TFLOP/s at the run's precision, for MFU (default: known "
         "for A100/H100/H200/B200 GPUs; none on CPU)", positive_float, metavar="TFLOPS"),
    Flag("log_interval", "steps between log lines", positive_int),
    Flag("timeline", "path prefix for the last step's measured timeline (.json, .png); 'none' to skip",
         optional_path),
    Flag("init_from", "take the weights from a Hugging Face directory (save_pretrained: model.safetensors or "
         "its sharded index); each rank reads only its shards", metavar="DIR"),
    Flag("checkpoint_dir", "save torch.distributed.checkpoint checkpoints here (atomic) at the end, every "
         "--save-interval steps and on SIGTERM/Ctrl-C, after which the job exits 128+signal "
         "(default: no checkpoints)", metavar="DIR"),
    Flag("save_interval", "save every N steps (default: only at the end)", positive_int, metavar="N"),
    Flag("resume", "continue from the latest checkpoint in --checkpoint-dir: model, optimizer, RNG and "
         "data position; any tp/pp/dp layout", None, Kind.SWITCH),
    Flag("overwrite", "start a new run in a --checkpoint-dir that holds another run's checkpoints, deleting "
         "them at this run's first save (without it, and without --resume, such a directory is refused)",
         None, Kind.SWITCH),
    Flag("resume_from", "like --resume, but from the checkpoint of STEP (an error if it is missing or "
         "corrupt); without it --resume takes the newest intact checkpoint", int, metavar="STEP"),
    Flag("export", "at the end, write the model's state_dict under its own parameter names, streamed one "
         "tensor at a time: a directory or *.safetensors gets safetensors (+ config.json for Hugging Face "
         "models: from_pretrained loads the directory), any other name one torch.save file",
         metavar="PATH"),
    Flag("keep_checkpoints", "newest checkpoints kept in --checkpoint-dir", positive_int, metavar="N"),
)
"""``TrainConfig``'s fields (fxpipe/job/train.py), but ``parallel`` (LAYOUT_FLAGS)."""

TARGET_FLAGS = _flags(
    Flag("batch", "sequences per batch B", positive_int),
    Flag("layers", "override the number of layers", positive_int),
    Flag("device", "device to build the model on; 'meta' allocates no weights (default: meta for "
         "gpt2-medium and larger, else cpu)"),
)
"""``fxpipe compile``'s ``CompileTarget`` fields besides ``model`` and ``seq`` (TRAIN_FLAGS')."""


def format_default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    return "none" if value is None else str(value)


def add_flags(parser: argparse.ArgumentParser, flags: Mapping[str, Flag], defaults: Mapping[str, Any],
              skip: frozenset[str] = frozenset()) -> None:
    """One argument per flag (default: left out of the namespace, so a flag not given
    overrides nothing); the help ends with the field's value in ``defaults``."""
    for name, flag in flags.items():
        if name in skip:
            continue
        shown = f" (default: {format_default(defaults[name])})" \
            if name in defaults and "(default:" not in flag.help else ""
        metavar = flag.metavar or (None if flag.choices else flag.key.upper().replace("-", "_"))
        if flag.kind is Kind.SWITCH:
            parser.add_argument(flag.option, dest=name, action="store_true", default=argparse.SUPPRESS,
                                help=flag.help + ("" if defaults.get(name) is False else shown))
        elif flag.kind is Kind.NEGATED:
            parser.add_argument(f"--no-{flag.key}", dest=name, action="store_false", default=argparse.SUPPRESS,
                                help=flag.help)
        else:
            parser.add_argument(flag.option, dest=name, type=flag.type, choices=flag.choices,
                                metavar=metavar, default=argparse.SUPPRESS, help=flag.help + shown)


DERIVED = ("chunks", "scatter_gather")
"""``ParallelConfig`` fields resolved from others when left None (chunks from the schedule,
scatter-gather from tp and sp): a layout built on a default keeps them unresolved."""


def with_layout(base: Any, fields: Mapping[str, Any]) -> Any:
    """``base`` (a ParallelConfig) with ``fields`` replaced and the derived fields
    resolved again unless given."""
    import dataclasses

    return dataclasses.replace(base, **{**{d: None for d in DERIVED}, **fields})


def in_flag_words(message: str) -> str:
    """An API message (the layout search's) in a CLI user's words: each ``field=value``
    as the flag and its value (``ep=2``: ``--ep 2``, ``sp=True``: ``--sp``), and the
    fields named alone whose names are no English word (``memory_limit_gb``)."""
    import re

    for field, flag in LAYOUT_FLAGS.items():
        def said(m: "re.Match[str]", flag: Flag = flag) -> str:
            value = m.group(1)
            if flag.kind is not Kind.VALUE and value in ("True", "False"):
                return flag.option if (value == "True") == (flag.kind is Kind.SWITCH) else f"no {flag.option}"
            return f"{flag.option} {value}"
        message = re.sub(rf"\b{field}=([^\s,;:]+)", said, message)
        if "_" in field:
            message = re.sub(rf"\b{field}\b", flag.option, message)
    return message


def given(args: argparse.Namespace, flags: Mapping[str, Flag]) -> dict[str, Any]:
    """The fields whose flags were given on the command line."""
    return {name: getattr(args, name) for name in flags if hasattr(args, name)}
