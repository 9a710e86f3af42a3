"""Packed windows of a token stream, a disjoint share per data-parallel replica, and a
position that checkpoints save.

Packing (as nanoGPT and Megatron do): the stream is documents separated by EOS;
window ``i`` is ``tokens[i·s : i·s + s + 1]`` — ``s`` inputs and their ``s`` next
tokens — so consecutive windows share one token and every token but the first is a
target once per epoch. There are ``(n - 1) // s`` windows; the ragged tail is dropped.

Order: each epoch visits every window once, in a permutation drawn from
``(seed, epoch)``; a step reads the next ``global_batch`` windows of that sequence.
The *position* is the count of windows consumed, a single integer independent of the
layout: replica ``r`` of ``dp`` reads rows ``[r·B/dp, (r+1)·B/dp)`` of the global
batch — exactly the rows ``ParallelModel.train_step`` gives that replica — so a run
resumed under another dp reads the same tokens in the same order, and the union of
the replicas' shares is the global batch a one-process run reads.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from fxpipe.data.tokens import TokenStream


@dataclass(frozen=True)
class PackedWindows:
    """Windows of ``seq`` + 1 tokens over a stream (a memmap is only paged in per window)."""
    stream: TokenStream
    seq: int
    first: int = 0
    """Index of the first window (a validation split starts after the training windows)."""
    count: int | None = None
    """Windows in this split (None: to the end of the stream)."""

    def __post_init__(self) -> None:
        total = (len(self.stream.tokens) - 1) // self.seq
        count = total - self.first if self.count is None else self.count
        assert 0 <= self.first and self.first + count <= total, (self.first, count, total)
        object.__setattr__(self, "count", count)

    @property
    def total_windows(self) -> int:
        return (len(self.stream.tokens) - 1) // self.seq

    def window(self, i: int) -> np.ndarray:
        start = (self.first + i) * self.seq
        return self.stream.read(start, start + self.seq + 1)

    def split(self, fraction: float) -> tuple["PackedWindows", "PackedWindows"]:
        """(training, validation): the last ``fraction`` of the windows held out."""
        held = max(1, int(round(self.count * fraction)))
        train = PackedWindows(self.stream, self.seq, self.first, self.count - held)
        return train, PackedWindows(self.stream, self.seq, self.first + self.count - held, held)


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, count: int) -> np.ndarray:
    """One epoch's permutation of ``count`` windows (8 B each), kept for the streams that
    read it: a rank's example batch and its training stream draw it once, not twice (a
    1 GB corpus has millions of windows: a third of a second each)."""
    order = np.random.default_rng([seed, epoch]).permutation(count)
    order.setflags(write=False)
    return order


@dataclass
class DataStream:
    """The batches one rank reads: ``next_batch()`` -> (B/dp, seq+1) int64 tokens of
    this replica's rows; ``position`` windows of the global order consumed so far."""
    windows: PackedWindows
    global_batch: int
    dp: int = 1
    dp_rank: int = 0
    seed: int = 0
    shuffle: bool = True
    position: int = 0

    def __post_init__(self) -> None:
        assert self.global_batch % self.dp == 0 and 0 <= self.dp_rank < self.dp

    def _window_index(self, k: int) -> int:
        epoch, offset = divmod(k, self.windows.count)
        if not self.shuffle:
            return offset
        return int(_epoch_order(self.seed, epoch, self.windows.count)[offset])

    def rows(self, position: int) -> range:
        """Global window counts of this replica's rows of the batch at ``position``."""
        share = self.global_batch // self.dp
        start = position + self.dp_rank * share
        return range(start, start + share)

    def next_batch(self) -> torch.Tensor:
        rows = np.stack([self.windows.window(self._window_index(k)) for k in self.rows(self.position)])
        self.position += self.global_batch
        return torch.from_numpy(rows.astype(np.int64))

    def global_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """The (B, seq+1) global batch ``train_step`` takes, holding this replica's rows in
        its place. Other replicas' rows are zeros that it never reads: train_step gives
        each data-parallel rank only its own rows (``ParallelModel._microbatches``)."""
        if self.dp == 1:
            return batch
        full = torch.zeros((self.global_batch, batch.shape[1]), dtype=batch.dtype)
        share = self.global_batch // self.dp
        full[self.dp_rank * share:(self.dp_rank + 1) * share] = batch
        return full

    def state(self) -> dict:
        """What a checkpoint keeps to continue at the same token (JSON-serialisable)."""
        return dict(position=self.position, windows=self.windows.count, seq=self.windows.seq,
                    seed=self.seed, source=self.windows.stream.source)

    def load_state(self, state: dict, steps: int | None = None) -> None:
        """Continue from a checkpoint's ``state()``, checked by ``checked_position``."""
        self.position = checked_position(state, self.windows, self.global_batch, self.seed, steps)


def checked_position(state: dict, windows: PackedWindows, global_batch: int, seed: int,
                     steps: int | None = None) -> int:
    """The position in a checkpoint's data ``state`` (``DataStream.state()``), refused when
    the data it counted in is not this run's (another window count or length: the position
    would point at other tokens), or when ``steps`` steps could not have read that far
    (each reads one global batch, and no batch is larger than the data: a position past
    that is not a count this run wrote). The launcher checks it before any worker starts,
    each worker again as it loads (``ValueError``, naming the numbers)."""
    position = state.get("position") if isinstance(state, dict) else None
    if type(position) is not int or position < 0:
        raise ValueError(f"the checkpoint's data position must be an integer >= 0, got {str(position)[:40]}")
    per_step = max(windows.count, global_batch)
    if steps is not None and position > steps * per_step:
        raise ValueError(f"the checkpoint's data position {position} is past what its {steps} steps can have read "
                         f"(at most {steps * per_step}: {steps} × {per_step} windows); the checkpoint's data "
                         f"state is damaged: resume from another step (--resume-from)")
    ours = (windows.count, windows.seq)
    theirs = (state.get("windows"), state.get("seq"))
    if theirs != ours:
        raise ValueError(f"the checkpoint was trained on {theirs[0]} windows of {theirs[1]} tokens "
                         f"({state.get('source')}), this run has {ours[0]} of {ours[1]} "
                         f"({windows.stream.source}); resume with the same --data and --seq")
    if state.get("seed") != seed:  # another seed is another order of the windows
        raise ValueError(f"the checkpoint's data order was drawn with --seed {state.get('seed')}, this run's "
                         f"is {seed}; resume with --seed {state.get('seed')}")
    return position
