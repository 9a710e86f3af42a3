"""What a checkpoint weighs, broken down the way BigScience's notes do (shared seeds:
"2 bytes per param for fp16 weights; 12 bytes are 8 bytes for optimizer and 4 bytes
for fp32 model"). fxpipe keeps no 16-bit copy in a checkpoint — the fp32 masters are
the weights — so an AdamW checkpoint is about 4 + 8 = 12 bytes per parameter.

Computed from DCP's index (each tensor's global shape and dtype), so it counts what
was written once, whatever the layout, plus the files' sizes on disk.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fxpipe.checkpoint.metadata import read_metadata


@dataclass(frozen=True)
class CheckpointSize:
    parameters: int
    """Elements of the ``model.*`` tensors (parameters and buffers, each tied group once)."""
    model_bytes: int
    optimizer_bytes: int
    other_bytes: int
    """RNG states, hyper-parameters."""
    file_bytes: tuple[int, ...]
    """Size on disk of each DCP data file (one per rank that wrote)."""

    def describe(self) -> str:
        n = max(self.parameters, 1)
        largest = max(self.file_bytes, default=0)
        return (f"{_size(sum(self.file_bytes))} in {len(self.file_bytes)} files (largest {_size(largest)}): "
                f"weights {_size(self.model_bytes)} = {self.model_bytes / n:.1f} B/param × "
                f"{self.parameters / 1e6:.2f}M, optimizer {_size(self.optimizer_bytes)} = "
                f"{self.optimizer_bytes / n:.1f} B/param, other {_size(self.other_bytes)}")


def _size(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    raise AssertionError


def checkpoint_size(path: str | Path) -> CheckpointSize:
    index = read_metadata(path).state_dict_metadata
    params = model = optim = other = 0
    for key, md in index.items():
        numel = 1
        for d in md.size:
            numel *= d
        nbytes = numel * torch.empty((), dtype=md.properties.dtype).element_size()
        if key.startswith("model."):
            params, model = params + numel, model + nbytes
        elif key.startswith("optim.state."):
            optim += nbytes
        else:
            other += nbytes
    files = tuple(sorted(f.stat().st_size for f in Path(path).glob("*.distcp")))
    return CheckpointSize(params, model, optim, other, files)
