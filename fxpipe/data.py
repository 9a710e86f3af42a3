"""Training text every machine has offline: the Python standard library's own source.

Tokens are bytes (vocabulary 256), so no tokenizer or download is needed. Batches
are a pure function of (seed, step): resuming at step k reproduces exactly the
batches an uninterrupted run would have seen, with no loader state to save.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch


def stdlib_corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    """Bytes of the standard library's .py files, sorted by path (deterministic)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, fn), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    if total == 0:
        raise RuntimeError(f"no Python source found under {root}")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


@dataclass(frozen=True)
class ByteBatches:
    """Random windows of the corpus: ``batch(step)`` -> (inputs, next-token targets)."""
    corpus: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0
    holdout: float = 0.05
    """The last fraction of the corpus is kept for validation batches."""

    def _windows(self, step: int, lo: int, hi: int, tag: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, tag, step])
        starts = rng.integers(lo, hi - self.seq_len - 1, size=self.batch_size)
        rows = np.stack([self.corpus[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        x = torch.from_numpy(rows)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        split = int(len(self.corpus) * (1 - self.holdout))
        return self._windows(step, 0, split, 0)

    def validation(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        split = int(len(self.corpus) * (1 - self.holdout))
        return self._windows(index, split, len(self.corpus), 1)
