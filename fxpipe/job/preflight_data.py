"""The data half of ``fxpipe run``'s preflight (``fxpipe/job/preflight.py``): the data is
opened (text tokenized into its cache, here, once) and checked before a worker
starts — a missing or empty file, a ``--data-dtype`` that does not divide the file,
fewer windows than one global batch, a resume's data position (``check_position``).
The largest id (read from the ids, never taken from a prepared cache's manifest) and
the tokenizer's vocabulary are returned for the model check, which names both against
the model's vocabulary (ids are never clamped)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from fxpipe.checkpoint.manifest import CorruptCheckpointError, read_manifest
from fxpipe.data import PackedWindows, open_data
from fxpipe.data.text import skipped_links
from fxpipe.data.windows import checked_position
from fxpipe.job.config import TrainConfig
from fxpipe.job.preflight_files import PreflightError
from fxpipe.job.prepare import corpus_options, tokenizer_path
from fxpipe.runtime.launch import threads_per_rank


def tokenizing_workers() -> int:
    """Processes that tokenize an uncached corpus here: the cores, shared among the local
    ranks when torchrun runs this check in each of them."""
    return threads_per_rank()


class _Progress:
    """A line on stderr at each tenth of a corpus tokenized (``fxpipe prepare-data`` draws a bar)."""

    def __init__(self) -> None:
        self.shown: dict[str, int] = {}

    def __call__(self, path: str, done: int, unit: str, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth > self.shown.get(path, 0) or path not in self.shown:
            self.shown[path] = tenth
            print(f"fxpipe run: tokenizing {path} ({tokenizing_workers()} processes; once, then cached): "
                  f"{min(done, total):,} of {total:,} {unit} ({min(tenth, 10) * 10}%)", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class DataFacts:
    largest_id: int
    """The largest token id in the training and validation data."""
    tokenizer_vocab: int | None
    """The tokenizer's vocabulary (None: a token file read without --tokenizer)."""
    source: str
    windows: PackedWindows
    """The training windows (a resume's data position is checked against them)."""


def check_data(config: "TrainConfig") -> DataFacts:

    flag = "--data" if config.data is not None else "the built-in data"
    try:
        source = open_data(config.data, seq=config.seq, val_data=config.val_data, val_fraction=config.val_fraction,
                           tokenizer=tokenizer_path(config), dtype=config.data_dtype.value,
                           options=corpus_options(config, workers=tokenizing_workers(), progress=_Progress()))
    except FileNotFoundError as exc:
        raise PreflightError(f"{flag}: no such file or directory: {exc.filename}") from None
    except (ValueError, OSError) as exc:
        raise PreflightError(f"{flag}: {' '.join(str(exc).split())}") from None
    train = source.train
    tokens = len(train.stream.tokens)
    if train.count < config.batch:
        need = config.batch * config.seq + 1
        raise PreflightError(
            f"{train.stream.source} holds {tokens} tokens: {train.count} training windows of --seq {config.seq} "
            f"+ 1, fewer than one global batch of {config.batch} sequences ({need} tokens"
            + (f" before the {config.val_fraction:g} validation share" if source.val is not None
               and config.val_data is None else "")
            + "); give more data, or lower --micro-batch-size, --microbatches, --dp or --seq")
    if source.val is not None and source.val.count == 0:
        raise PreflightError(f"--val-data {config.val_data} holds {len(source.val.stream.tokens)} tokens, fewer than "
                             f"one window of --seq {config.seq} + 1; give more validation data")
    for flag_, path in (("--data", config.data), ("--val-data", config.val_data)):
        links = skipped_links(Path(path)) if path is not None else []
        if links:  # never read (a link could lead outside the data), and never silently
            print(f"fxpipe run: note: {flag_} {path}: {len(links)} linked file(s) not read (links are not followed: "
                  f"copy the files in instead): {', '.join(str(p) for p in links[:3])}"
                  f"{' ...' if len(links) > 3 else ''}", file=sys.stderr, flush=True)
    # The ids themselves, read once here (the whole stream: validation windows included),
    # not a prepared cache's manifest: a forged cache rewrites its record with its ids.
    streams = [(flag, train.stream)]
    if source.val is not None and source.val.stream is not train.stream:
        streams.append(("--val-data" if config.val_data is not None else flag, source.val.stream))
    largest = -1
    for flag_, stream in streams:
        try:
            largest = max(largest, stream.scanned_largest_id())
        except ValueError as exc:
            raise PreflightError(f"{flag_}: {exc}") from None
    return DataFacts(largest, source.tokenizer_vocab, train.stream.source, train)


def check_position(path: Path, config: "TrainConfig", data: DataFacts) -> None:
    """The data position of the checkpoint a resume takes (its manifest's ``extra.data``,
    written by ``DataStream.state()``) against this run's windows, seed and the steps it
    saved: a damaged one is refused here, naming the checkpoint and the numbers, instead
    of on rank 0 after every worker started (``checked_position``, which each worker
    applies again as it loads)."""
    try:
        meta = read_manifest(path)  # type-checked (its digests: verified by resume_path)
    except CorruptCheckpointError as exc:
        raise PreflightError(f"--resume: {exc}") from None
    state = meta["extra"].get("data")
    if state is None:  # saved before the position was kept: a worker counts one global batch per step
        return
    try:
        checked_position(state, data.windows, config.batch, config.parallel.seed, steps=meta["step"])
    except ValueError as exc:
        raise PreflightError(f"--resume: {path}: {exc}") from None
