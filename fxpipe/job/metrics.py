"""What ``fxpipe run`` records per step: the metrics file (JSON lines) and TensorBoard
events, and this process's peak memory."""
from __future__ import annotations

import json
from typing import Any

import torch

from fxpipe.base.safe_io import open_output


class MetricsWriter:
    """One JSON object per line (rank 0 only) and, when the ``tensorboard`` package is
    installed and a directory given, the same scalars as TensorBoard events."""

    def __init__(self, path: str | None, tensorboard_dir: str | None,
                 forbidden: frozenset[tuple[int, int]] = frozenset()) -> None:
        # ``forbidden``: the run's inputs by identity (job/input_registry.py), checked on the opened file
        self.file = open_output(path, append=True, forbidden=forbidden) if path else None  # closed in close()
        self.tb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        record = {k: v for k, v in record.items() if v is not None}  # e.g. no MFU without a known peak
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def peak_memory_gib() -> float:
    """This process's peak memory: the GPU's allocator peak, else the peak resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
