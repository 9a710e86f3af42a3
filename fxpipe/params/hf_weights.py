"""Weights in: a Hugging Face checkpoint directory read slice by slice.

``parallelize(model, weights=DIR)`` (``fxpipe run --init-from DIR``) takes each
parameter this rank holds from ``DIR``'s safetensors — ``model.safetensors``, or the
shards named by ``model.safetensors.index.json`` — reading only the rank's
tensor-parallel ranges (``safe_open(...).get_slice``; a non-contiguous spec reads
each range), never a whole sharded tensor. Names are the model's ``state_dict``
names; a tied group may be stored under any of its names (``save_pretrained`` keeps
one). Before anything is read, the directory's names, shapes and dtypes are checked
against the model and every mismatch is listed (``fxpipe run`` does it in the
launcher, from the files' headers alone).

The directory is hostile input: the index is a regular file read under a cap; every
file it names must resolve inside the directory (a Hugging Face hub snapshot's links
into its repository's ``blobs/`` are allowed: that is how the hub cache stores
files); an index beside a ``model.safetensors`` it does not describe, or older than
it, is refused naming both (one of them is stale); a tensor whose stored dtype is
not the model's is refused unless the change is a float widening (bf16/fp16 -> fp32,
the masters fxpipe trains), never an integer or bool cast to float in silence.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open

from fxpipe.base.safe_io import UnsafeFileError, check_regular, inside, read_bounded, read_json_object
from fxpipe.ir.shard_spec import ShardKind, ShardSpec
from fxpipe.ir.state_mismatch import raise_if_mismatched
from fxpipe.params.hf_conversion import conversions

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_CONFIG_BYTES = 4 << 20
"""config.json larger than this is refused unread (a real one is a few KB)."""
MAX_INDEX_BYTES = 64 << 20
"""An index larger than this is refused unread (a 405B model's is ~100 KB)."""
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _stamp(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y-%m-%d %H:%M:%S")


def _weight_map(directory: Path) -> dict[str, str]:
    try:
        doc = json.loads(read_bounded(directory / INDEX, MAX_INDEX_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{directory / INDEX} is not readable JSON ({type(exc).__name__})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and Path(v).name == v and v.endswith(".safetensors")
            for k, v in weight_map.items()):
        raise ValueError(f"{directory / INDEX}: must be a JSON object whose 'weight_map' maps tensor names "
                         f"to file names in the same directory")
    return weight_map


def _model_type(directory: Path) -> str | None:
    """``model_type`` of the directory's config.json (None without one): which of
    transformers' conversion mappings its checkpoint was written for."""
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        kind = read_json_object(path, MAX_CONFIG_BYTES).get("model_type")
    except (OSError, ValueError):  # a damaged config.json is the model loader's to refuse
        return None
    return kind if isinstance(kind, str) else None


def _check_inside(path: Path, directory: Path) -> None:
    """A weights file must be a regular file inside the directory once links are resolved;
    a hub snapshot (``.../snapshots/<rev>/``) may link into its repository's ``blobs/``."""
    check_regular(path)
    if inside(path, directory):
        return
    if directory.parent.name == "snapshots" and inside(path, directory.parent.parent / "blobs"):
        return
    raise UnsafeFileError(f"{path} leads outside {directory} (to {os.path.realpath(path)}); copy the file "
                          f"into the directory instead of linking it")


def _keys(path: Path) -> list[str]:
    check_regular(path)  # safe_open of a FIFO would wait for a writer forever
    with safe_open(path, "pt") as f:
        return list(f.keys())


def _files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index, single = directory / INDEX, directory / SINGLE
    if index.exists():
        weight_map = _weight_map(directory)
        if single.exists() and (set(weight_map.values()) != {SINGLE} or set(weight_map) != set(_keys(single))
                                or index.stat().st_mtime < single.stat().st_mtime):
            # Both describe the weights: one is left over from an earlier save. Which one
            # from_pretrained would pick is not a guess to make for the user.
            raise ValueError(f"{index} (written {_stamp(index)}) does not describe {single} (written "
                             f"{_stamp(single)}) beside it: one of them is stale; remove it")
        return {k: directory / v for k, v in weight_map.items()}
    if single.exists():
        return {k: single for k in _keys(single)}
    raise FileNotFoundError(f"{directory}: no {SINGLE} or {INDEX} (a directory written by save_pretrained)")


def _allowed(stored: torch.dtype, model: torch.dtype) -> bool:
    """The same dtype, or a float widened to the model's (at least fp32: fxpipe's masters)."""
    if stored == model:
        return True
    return stored.is_floating_point and model.is_floating_point and \
        torch.finfo(stored).bits <= max(torch.finfo(model).bits, 32)


class WeightsDir:
    """A safetensors directory's names, shapes and dtypes (headers only), and its reader."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        try:
            self.files = _files(self.directory)
            for path in sorted(set(self.files.values())):
                _check_inside(path, self.directory)
                with safe_open(path, "pt") as f:
                    for k in f.keys():
                        sl = f.get_slice(k)
                        self.shapes[k], self.dtypes[k] = tuple(sl.get_shape()), sl.get_dtype()
        except SafetensorError as exc:  # a malformed header: not a ValueError of its own
            raise ValueError(f"{self.directory}: a safetensors file is malformed ({exc})") from None
        # Per-expert tensors on disk as transformers converts them on load (hf_conversion.py):
        # the model's names from here on; ``alias`` and ``stacked`` say where each is stored.
        self.alias, self.stacked = conversions(_model_type(self.directory),
                                               {k: (self.shapes[k], self.dtypes[k]) for k in self.shapes})
        for model, stored in self.alias.items():
            self.shapes[model], self.dtypes[model] = self.shapes.pop(stored), self.dtypes.pop(stored)
        for model, st in self.stacked.items():
            for n in st.names():
                self.shapes.pop(n), self.dtypes.pop(n)
            self.shapes[model], self.dtypes[model] = st.shape, st.dtype

    def _stored_region(self, stored: str, index: tuple[slice, ...]) -> torch.Tensor:
        with safe_open(self.files[stored], "pt") as f:
            sl = f.get_slice(stored)
            return sl[index] if index else sl[:]

    def region(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dimension ``dim`` of model tensor ``name``, every other
        dimension whole: read from its file, or stacked from its per-expert parts."""
        if name in self.stacked:
            return self.stacked[name].region(self._stored_region, dim, start, stop)
        stored = self.alias.get(name, name)
        return self._stored_region(stored, (slice(None),) * dim + (slice(start, stop),))

    def whole(self, name: str) -> torch.Tensor:
        """Model tensor ``name`` whole (a scalar too)."""
        shape = self.shapes[name]
        return self.region(name, 0, 0, shape[0]) if shape else self._stored_region(self.alias.get(name, name), ())

    def check(self, names: Mapping[str, str], full_shapes: Mapping[str, tuple[int, ...]],
              required: set[str], dtypes: Mapping[str, torch.dtype] | None = None) -> dict[str, str]:
        """Canonical name -> the stored name to read it from. ``names``: every state_dict
        name -> its canonical name; ``required``: canonical names that must be present;
        ``dtypes``: canonical name -> the model's dtype. Raises ValueError listing
        missing / unexpected / mis-shaped tensors and refused dtype changes."""
        source: dict[str, str] = {}
        for name, canonical in names.items():
            if name in self.shapes:
                source.setdefault(canonical, name)
        problems = [f"{c}: file {self.shapes[s]} vs model {tuple(full_shapes[c])}" for c, s in sorted(source.items())
                    if tuple(self.shapes[s]) != tuple(full_shapes[c])]
        tied: dict[str, list[str]] = {}
        for name, canonical in names.items():
            if name in self.shapes:
                tied.setdefault(canonical, []).append(name)
        for c, stored_names in sorted(tied.items()):
            # One parameter stored under two of its tied names: the model keeps one, so the
            # file must hold one matrix twice, not two (a tied config over untied weights).
            for other in stored_names[1:]:
                if not self._same(stored_names[0], other):
                    problems.append(f"{stored_names[0]} and {other} are one tied parameter in the model "
                                    f"(tie_word_embeddings), but different tensors in the file: set "
                                    f"\"tie_word_embeddings\": false in config.json, or save the weights again")
        for c, s in sorted(source.items()):
            stored = _DTYPES.get(self.dtypes[s])
            if dtypes is not None and c in dtypes and (stored is None or not _allowed(stored, dtypes[c])):
                problems.append(f"{s}: file dtype {self.dtypes[s]} vs model {str(dtypes[c]).removeprefix('torch.')} "
                                f"(only a float widening is converted)")
        raise_if_mismatched(
            f"weights {self.directory} do not match the model",
            sorted(c for c in required if c not in source), sorted(k for k in self.shapes if k not in names),
            problems)
        return source

    def _same(self, a: str, b: str, rows: int = 4096) -> bool:
        """Whether stored tensors ``a`` and ``b`` hold the same values, read ``rows`` rows at
        a time (an embedding table need not fit in memory twice)."""
        if self.shapes[a] != self.shapes[b]:
            return False
        if not self.shapes[a]:
            return torch.equal(self.whole(a), self.whole(b))
        for start in range(0, self.shapes[a][0], rows):
            stop = min(start + rows, self.shapes[a][0])
            if not torch.equal(self.region(a, 0, start, stop), self.region(b, 0, start, stop)):
                return False
        return True

    def read(self, stored: str, spec: ShardSpec | None, tp_rank: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of ``stored`` (zero padding rows appended), in ``dtype``."""
        if spec is None or spec.kind is ShardKind.REPLICATED:
            return self.whole(stored).to(dtype)
        parts = [self.region(stored, spec.dim, a, b).to(dtype) for a, b in spec.ranges[tp_rank]]
        pad = spec.padding(tp_rank)
        if pad:
            shape = list(parts[0].shape)
            shape[spec.dim] = pad
            parts.append(torch.zeros(shape, dtype=dtype))
        return torch.cat(parts, dim=spec.dim) if len(parts) > 1 else parts[0]
