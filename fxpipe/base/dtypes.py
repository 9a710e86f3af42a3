"""Bytes per element of a dtype: the one place every layer asks (costs, transfers, shards)."""
from __future__ import annotations

import torch


def _itemsize(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 1
    return torch.empty((), dtype=dtype, device="meta").element_size()


def itemsize(dtype: torch.dtype) -> int:
    return _itemsize(dtype)
