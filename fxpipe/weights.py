"""Weights in: a Hugging Face checkpoint directory read slice by slice.

``parallelize(model, weights=DIR)`` (``fxpipe run --init-from DIR``) takes each
parameter this rank holds from ``DIR``'s safetensors — ``model.safetensors``, or the
shards named by ``model.safetensors.index.json`` — reading only the rank's
tensor-parallel ranges (``safe_open(...).get_slice``; a non-contiguous spec reads
each range), never a whole sharded tensor. Names are the model's ``state_dict``
names; a tied group may be stored under any of its names (``save_pretrained`` keeps
one). Before anything is read, the directory's names and shapes are checked against
the model and every mismatch is listed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open

from fxpipe.mismatch import raise_if_mismatched
from fxpipe.passes.tensor_parallel.specs import ShardKind, ShardSpec

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and Path(v).name == v and v.endswith(".safetensors")
                for k, v in weight_map.items()):
            raise ValueError(f"{directory / INDEX}: 'weight_map' must map tensor names to file names in "
                             f"the same directory")
        return {k: directory / v for k, v in weight_map.items()}
    if (directory / SINGLE).is_file():
        with safe_open(directory / SINGLE, "pt") as f:
            return {k: directory / SINGLE for k in f.keys()}
    raise FileNotFoundError(f"{directory}: no {SINGLE} or {INDEX} (a directory written by save_pretrained)")


class WeightsDir:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.files = _files(self.directory)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(set(self.files.values())):
            with safe_open(path, "pt") as f:
                for k in f.keys():
                    self.shapes[k] = tuple(f.get_slice(k).get_shape())

    def check(self, names: Mapping[str, str], full_shapes: Mapping[str, tuple[int, ...]],
              required: set[str]) -> dict[str, str]:
        """Canonical name -> the stored name to read it from. ``names``: every state_dict
        name -> its canonical name; ``required``: canonical names that must be present.
        Raises ValueError listing missing / unexpected / mis-shaped tensors."""
        source: dict[str, str] = {}
        for name, canonical in names.items():
            if name in self.shapes:
                source.setdefault(canonical, name)
        raise_if_mismatched(
            f"weights {self.directory} do not match the model",
            sorted(c for c in required if c not in source), sorted(k for k in self.shapes if k not in names),
            [f"{c}: file {self.shapes[s]} vs model {tuple(full_shapes[c])}" for c, s in sorted(source.items())
             if tuple(self.shapes[s]) != tuple(full_shapes[c])])
        return source

    def read(self, stored: str, spec: ShardSpec | None, tp_rank: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of ``stored`` (zero padding rows appended), in ``dtype``."""
        with safe_open(self.files[stored], "pt") as f:
            sl = f.get_slice(stored)
            if spec is None or spec.kind is ShardKind.REPLICATED:
                return sl[:].to(dtype)
            lead = (slice(None),) * spec.dim
            parts = [sl[(*lead, slice(a, b))].to(dtype) for a, b in spec.ranges[tp_rank]]
        pad = spec.padding(tp_rank)
        if pad:
            shape = list(parts[0].shape)
            shape[spec.dim] = pad
            parts.append(torch.zeros(shape, dtype=dtype))
        return torch.cat(parts, dim=spec.dim) if len(parts) > 1 else parts[0]
