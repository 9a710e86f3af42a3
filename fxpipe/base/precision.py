"""Training precision, a name parsed once (the runtime keeps the masters and the loss
scaler in ``runtime/mixed_precision.py``)."""
from __future__ import annotations

import enum

import torch


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16,
                Precision.FP16: torch.float16}[self]

    @staticmethod
    def parse(name: "str | Precision") -> "Precision":
        if isinstance(name, Precision):
            return name
        try:
            return Precision(name)
        except ValueError:
            raise ValueError(f"unknown precision {name!r}; valid: fp32, bf16, fp16") from None
