"""Reading DCP's ``.metadata`` index as hostile input.

torch.distributed.checkpoint writes its index with ``pickle`` and its own reader
loads it with ``pickle.load``, so a crafted index runs code. fxpipe reads it here
instead, in two steps:

1. **An exact allow-list of (module, name) pairs.** Python's "restricting globals"
   recipe (pickle docs). The check is on the exact pair and no allowed name contains
   a dot: protocol 4+ resolves dotted names (``Metadata.__init__.__globals__``), and a
   module-wide allow-list would admit anything importable from that module (a
   ``torch.distributed.checkpoint.metadata`` module attribute that is ``os``, say).
   Before anything is unpickled, the opcode stream is scanned against an allow-list
   of opcodes (copyreg's extension opcodes can return a cached object without
   ``find_class``); persistent ids are refused.
2. **The loaded structure is validated** before DCP sees it: only tensor entries (no
   pickled-bytes entries, which DCP would ``torch.load(weights_only=False)``), sizes
   and chunks that agree, and storage records that name a DCP data file of this
   directory (``__<rank>_<n>.distcp``, no path components) with an in-bounds byte range
   and no load-time transforms. Allowed classes built from hostile arguments (a
   ``PosixPath`` where a chunk list belongs, a negative length) are refused here.

The tensor data itself is read by DCP with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from fxpipe.base.safe_io import UnsafeFileError, read_bounded

MAX_METADATA_BYTES = 1 << 30
"""An index larger than this is refused before unpickling (a 175B model's is ~MBs)."""

_DCP = "torch.distributed.checkpoint"
_DTYPE_NAMES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (f"{_DCP}.metadata", "Metadata"),
    (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    *(("torch", name) for name in _DTYPE_NAMES),
})
"""Everything DCP's index of a tensor-only state dict refers to (read off real indexes
of every dtype); nothing else."""

DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "NEWOBJ", "NEWOBJ_EX",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
    "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "GET", "BINGET", "LONG_BINGET",
})
"""Opcodes an index may use. Left out on purpose: EXT1/EXT2/EXT4 (copyreg's extension
registry: an object cached there by an earlier unpickle is returned without
``find_class``), PERSID/BINPERSID, INST/OBJ (protocol 0/1 calls), and the
out-of-band buffer opcodes."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that is malformed or refers to anything outside the allow-list."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"refers to {module}.{name}, which a DCP index of tensors never "
                                    f"needs; refusing to load it (no code runs from a checkpoint)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("uses a pickle persistent id, which a DCP index never does")


def read_metadata(directory: str | os.PathLike) -> Metadata:
    """DCP's index of ``directory``, unpickled with the allow-list and validated.
    Raises ``UnsafeCheckpointError`` naming the file and what is wrong."""
    root = Path(directory)
    path = root / ".metadata"
    try:
        try:  # a regular file, not a link, at most the cap (fxpipe/base/safe_io.py)
            data = read_bounded(path, MAX_METADATA_BYTES, follow=False)
        except UnsafeFileError as exc:
            raise UnsafeCheckpointError(f"is refused: {exc}") from None
        _check_opcodes(data)
        try:
            metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:  # truncated, wrong opcode arguments, constructor errors ...
            raise UnsafeCheckpointError(f"is not a readable DCP index ({type(exc).__name__}: {exc})") from exc
        _validate(metadata, root)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"checkpoint index {path} {exc}") from None
    return metadata


def _check_opcodes(data: bytes) -> None:
    """Scan the opcode stream before executing any of it (pickletools only decodes)."""
    try:
        for op, _, pos in pickletools.genops(data):
            if op.name not in _OPCODES:
                raise UnsafeCheckpointError(f"uses pickle opcode {op.name} at byte {pos}, which a DCP "
                                            f"index never needs; refusing to load it")
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or not a pickle at all
        raise UnsafeCheckpointError(f"is not a readable DCP index ({type(exc).__name__}: {exc})") from exc


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise UnsafeCheckpointError(f"is malformed: {what}")


def _is_size(value: Any, ndim: int | None = None) -> bool:
    return (type(value) is torch.Size and all(type(d) is int and d >= 0 for d in value)
            and (ndim is None or len(value) == ndim))


def _validate(md: Any, root: Path) -> None:
    _require(type(md) is Metadata, f"top-level object is {type(md).__name__}, not Metadata")
    _require(type(md.state_dict_metadata) is dict, "state_dict_metadata is not a dict")
    for key, entry in md.state_dict_metadata.items():
        _require(type(key) is str, f"key {key!r} is not a string")
        # Only tensors: DCP loads a bytes entry with torch.load(weights_only=False).
        _require(type(entry) is TensorStorageMetadata, f"{key!r} is a {type(entry).__name__}, not a tensor entry")
        props = entry.properties
        _require(type(props) is TensorProperties and isinstance(props.dtype, torch.dtype)
                 and props.layout is torch.strided, f"{key!r} has bad tensor properties")
        _require(_is_size(entry.size), f"{key!r} has a bad size {entry.size!r}")
        _require(type(entry.chunks) is list, f"{key!r} chunks are not a list")
        for chunk in entry.chunks:
            _require(type(chunk) is ChunkStorageMetadata and _is_size(chunk.offsets, len(entry.size))
                     and _is_size(chunk.sizes, len(entry.size))
                     and all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.size)),
                     f"{key!r} has a chunk outside its size {tuple(entry.size)}")
    _require(type(md.storage_data) is dict, "storage_data is not a dict")
    file_sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        _require(type(index) is MetadataIndex and type(index.fqn) is str
                 and index.fqn in md.state_dict_metadata, f"storage record for unknown key {index!r}")
        _require(type(info) is _StorageInfo and type(info.relative_path) is str
                 and bool(DATA_FILE.match(info.relative_path)),
                 f"{index.fqn!r} is stored in {getattr(info, 'relative_path', info)!r}, not a DCP data "
                 f"file of this directory")
        _require(not info.transform_descriptors, f"{index.fqn!r} asks for load transforms")
        if info.relative_path not in file_sizes:
            data = root / info.relative_path
            _require(data.is_file() and not data.is_symlink(), f"data file {info.relative_path} is missing")
            file_sizes[info.relative_path] = data.stat().st_size
        _require(type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0
                 and info.offset + info.length <= file_sizes[info.relative_path],
                 f"{index.fqn!r} reads bytes {info.offset}+{info.length} beyond {info.relative_path}")
    _require(md.planner_data is None or (type(md.planner_data) is dict and all(
        type(k) is str and type(v) in (tuple, list) and all(type(x) in (str, int) for x in v)
        for k, v in md.planner_data.items())), "planner_data is not a key -> path mapping")
    sm = md.storage_meta
    _require(sm is None or (type(sm) is StorageMeta and all(
        v is None or isinstance(v, (str, os.PathLike)) for v in (sm.checkpoint_id, sm.save_id, sm.load_id))
        and type(sm.modules) is list and all(type(m) is str for m in sm.modules)), "storage_meta is malformed")
    _require(md.version is None or type(md.version) is str, "version is not a string")
