"""Consolidated export: one file of the unmodified model's ``state_dict``, streamed.

``export_consolidated(source, path)`` reads a checkpoint directory (or, from a live
job, first writes the model's tensors as a model-only DCP checkpoint: every rank its
own shards, no gather) and writes the state dict one tensor at a time:

- ``path`` ending in ``.safetensors``, or a directory: safetensors (Hugging Face's
  format; a directory gets ``model.safetensors`` split into
  ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` above
  ``max_shard_bytes``, and ``config.json`` when an HF config is given, so
  ``from_pretrained(path)`` loads it). Tied names are stored once, under the
  canonical (first registered) name, as ``save_pretrained`` does. The file is written
  by a streaming writer: the header (names, dtypes, shapes, offsets) is known from
  DCP's index before any tensor is read, so peak memory is one tensor.
- anything else: one ``torch.save``d dict with every ``state_dict`` name (tied names
  sharing one tensor), loadable with ``torch.load(path, weights_only=True)`` — this
  format needs the whole model in memory on the writing process.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from fxpipe.checkpoint.files import SafeReader, is_complete, resolve
from fxpipe.checkpoint.manifest import CorruptCheckpointError, file_names, read_manifest, verify
from fxpipe.checkpoint.state import _model_state, read_dcp, state_dict_names

# safetensors dtype codes (the format's spec: huggingface/safetensors README).
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
MAX_SHARD_BYTES = 5 * 2**30
"""Split a directory export into files of at most this size (Hugging Face's default)."""


def _quiet_load(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with warnings.catch_warnings():  # DCP notes that it loads without a process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        read_dcp(tensors, path, no_dist=True)


class _Source:
    """A checkpoint directory as (state_dict name -> canonical key, shape, dtype)."""

    def __init__(self, path: Path, names: dict[str, str]) -> None:
        index = SafeReader(path).read_metadata().state_dict_metadata
        missing = sorted({c for c in names.values() if f"model.{c}" not in index})
        if missing:
            raise ValueError(f"checkpoint {path} lacks model tensors {missing[:8]}")
        self.path, self.names = path, names
        self.meta = {c: (tuple(index[f"model.{c}"].size), index[f"model.{c}"].properties.dtype)
                     for c in dict.fromkeys(names.values())}

    def read(self, canonical: str) -> torch.Tensor:
        shape, dtype = self.meta[canonical]
        box = {f"model.{canonical}": torch.empty(shape, dtype=dtype)}
        _quiet_load(box, self.path)
        return box[f"model.{canonical}"]


def _directory_source(directory: str | os.PathLike) -> _Source:
    path = Path(directory)
    path = path if is_complete(path) else resolve(path, None)
    meta = read_manifest(path)  # type-checked
    problems = verify(path, meta, file_names(meta))
    if problems:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems)}")
    return _Source(path, meta["state_dict"])


# ---- the safetensors writer ----------------------------------------------------------------------
def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _write_safetensors(out: Path, entries: list[tuple[str, str]], source: _Source,
                       metadata: dict[str, str]) -> None:
    """``entries``: (name in the file, canonical key). Header first (8-byte little-endian
    length, JSON, space-padded to 8 bytes), then each tensor's bytes in order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, canonical in entries:
        shape, dtype = source.meta[canonical]
        if dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {dtype} has no safetensors code")
        size = _nbytes(shape, dtype)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, canonical in entries:
            t = source.read(canonical).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            del t
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def _shards(entries: list[tuple[str, str]], source: _Source, limit: int) -> Iterator[list[tuple[str, str]]]:
    part: list[tuple[str, str]] = []
    size = 0
    for entry in entries:
        n = _nbytes(*source.meta[entry[1]])
        if part and size + n > limit:
            yield part
            part, size = [], 0
        part.append(entry)
        size += n
    if part:
        yield part


def _export_safetensors(source: _Source, path: Path, hf_config: Any, max_shard_bytes: int) -> list[Path]:
    # One entry per tensor: the canonical (first registered) name of each tied group.
    entries = [(c, c) for c in dict.fromkeys(source.names.values())]
    tied = {n: c for n, c in source.names.items() if n != c}
    metadata = {"format": "pt", "fxpipe_tied": json.dumps(tied)}
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_safetensors(path, entries, source, metadata)
        return [path]
    path.mkdir(parents=True, exist_ok=True)
    parts = list(_shards(entries, source, max_shard_bytes))
    files = []
    index = path / "model.safetensors.index.json"
    if len(parts) == 1:
        files.append(path / "model.safetensors")
        _write_safetensors(files[0], parts[0], source, metadata)
    else:
        weight_map = {}
        for i, part in enumerate(parts, 1):
            f = path / f"model-{i:05d}-of-{len(parts):05d}.safetensors"
            _write_safetensors(f, part, source, metadata)
            weight_map.update({name: f.name for name, _ in part})
            files.append(f)
        total = sum(_nbytes(*source.meta[c]) for _, c in entries)
        tmp = index.with_name(f".{index.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        os.replace(tmp, index)
    _remove_replaced(path, files, index)
    if hf_config is not None:
        hf_config.save_pretrained(path)
    return files


def _remove_replaced(path: Path, written: list[Path], index: Path) -> None:
    """Weights files of an earlier export into this directory that this one replaces: a
    stale index beside a new ``model.safetensors`` (or the other way round) would
    shadow the new weights for a reader (``from_pretrained``, ``--init-from``)."""
    stale = [f for f in [path / "model.safetensors", *path.glob("model-*-of-*.safetensors")]
             if f.is_file() and f not in written]
    if len(written) == 1 and path / "model.safetensors" in written and index.exists():
        stale.append(index)
    for f in stale:
        f.unlink()


def _export(source: _Source, path: Path, hf_config: Any, max_shard_bytes: int) -> Any:
    if path.suffix == ".safetensors" or path.suffix == "" or path.is_dir():
        return _export_safetensors(source, path, hf_config, max_shard_bytes)
    state = {}
    cache: dict[str, torch.Tensor] = {}
    for name, canonical in source.names.items():
        state[name] = cache.setdefault(canonical, source.read(canonical))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return state


def export_consolidated(source: Any, path: str | os.PathLike, *, hf_config: Any = None,
                        max_shard_bytes: int = MAX_SHARD_BYTES) -> Any:
    """Write the unmodified model's ``state_dict`` to ``path`` (format by suffix, above).

    ``source``: a checkpoint directory (root or ``step_*``; no process group needed) or
    a ParallelModel (collective: every rank writes its own shards to a temporary
    model-only checkpoint beside ``path``; global rank 0 then streams the export and
    removes it). ``hf_config``: a Hugging Face config to write beside a directory
    export. Returns the written files (safetensors) or the state dict (``.pt``; on
    the writing rank, None elsewhere)."""
    out = Path(path)
    if isinstance(source, (str, os.PathLike)):
        return _export(_directory_source(source), out, hf_config, max_shard_bytes)
    pm, rank = source, dist.get_rank()
    tmp = out.parent / f".{out.name}.model-only.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _model_state(pm)
    names = state_dict_names(pm.plan.program)
    dcp.save(state, storage_writer=FileSystemWriter(tmp))
    result = None
    try:
        if rank == 0:
            result = _export(_Source(tmp, names), out, hf_config, max_shard_bytes)
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
    return result
