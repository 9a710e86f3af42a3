"""``fxpipe.json``: the manifest of a checkpoint, read as hostile input.

It is JSON (never pickled) and lists every file of the checkpoint with its size and
SHA-256 (``files``), besides the step, the layout and the state_dict names. A
checkpoint is complete only if every listed file is present at its size
(``is_complete``, cheap: a stat per file) and intact only if every digest matches
(``verify``, reads every byte; in a job the ranks share the files between them).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

FORMAT = 2
"""2: ``files`` with digests. Format-1 checkpoints (no digests) still load, unverified."""
META_FILE = "fxpipe.json"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is refused before parsing (a GPT-3-sized one is ~100 KB)."""
SCALER_FIELDS = ("scale", "good_steps", "skipped")


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files are missing, truncated, altered or malformed."""


class CheckpointFallbackWarning(UserWarning):
    """A resume skipped damaged checkpoints (or an unusable ``latest``) for an older one."""


def digest(path: Path, chunk: int = 1 << 22) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def _fail(path: Path, what: str) -> None:
    raise CorruptCheckpointError(f"{path / META_FILE}: {what}")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name}")  # NaN/Infinity: not JSON (RFC 8259), json accepts them


def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_finite(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _scaler_ok(v: Any) -> bool:
    # fp16's loss scaler (runtime/precision.py), restored field by field on load.
    return v is None or (isinstance(v, dict) and set(v) == set(SCALER_FIELDS) and _is_finite(v["scale"])
                         and v["scale"] > 0 and _is_count(v["good_steps"]) and _is_count(v["skipped"]))


_CHECKS = {
    "step": _is_count,
    "extra": lambda v: isinstance(v, dict),
    "world_size": lambda v: type(v) is int and v >= 1,
    "mesh": lambda v: isinstance(v, dict) and set(v) == {"pp", "dp", "tp"}
    and all(type(x) is int and x >= 1 for x in v.values()),
    "state_dict": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                                        for k, x in v.items()),
    "source": lambda v: isinstance(v, str),
    "precision": lambda v: v in ("fp32", "bf16", "fp16"),
    "loss_scaler": _scaler_ok,
}
_FILES_CHECK = {"files": lambda v: isinstance(v, dict) and ".metadata" in v and all(
    isinstance(k, str) and _FILE_NAME.match(k) and isinstance(e, dict) and set(e) == {"bytes", "sha256"}
    and _is_count(e["bytes"]) and isinstance(e["sha256"], str) and _HEX64.match(e["sha256"])
    for k, e in v.items())}


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed and type-checked manifest of checkpoint directory ``path``. It is
    read from disk, so every field is checked before anything uses it (a size cap
    first; no NaN, no runaway nesting), and the step must be its directory's."""
    f = path / META_FILE
    try:
        size = f.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{f} is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
        meta = json.loads(f.read_bytes().decode("utf-8"), parse_constant=_refuse_constant)
    except CorruptCheckpointError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(f"{f} is not readable JSON ({type(exc).__name__}: "
                                     f"{str(exc)[:200]})") from None
    if not isinstance(meta, dict):
        _fail(path, "is not a JSON object")
    fmt = meta.get("format")
    if type(fmt) is not int or fmt not in (1, FORMAT):
        _fail(path, f"has format {str(fmt)[:32]!r}; this fxpipe reads 1 and {FORMAT}")
    checks = {**_CHECKS, **(_FILES_CHECK if fmt == FORMAT else {})}
    for key, ok in checks.items():
        if key not in meta or not ok(meta[key]):
            _fail(path, f"field {key!r} is missing or malformed")
    if meta["mesh"]["pp"] * meta["mesh"]["dp"] * meta["mesh"]["tp"] != meta["world_size"]:
        _fail(path, f"mesh {meta['mesh']} does not multiply to its world size {meta['world_size']}")
    named = re.match(r"^step_(\d+)$", path.name)
    if named and int(named.group(1)) != meta["step"]:
        _fail(path, f"says step {meta['step']}, but it is in {path.name}")
    return meta


def why_incomplete(path: Path) -> str | None:
    """None if every file the manifest lists is present at its recorded size (format 2),
    or DCP's index and the manifest exist (format 1); else what is wrong, naming the file."""
    try:
        meta = read_manifest(path)
    except CorruptCheckpointError as exc:
        return str(exc)
    if meta["format"] == 1:
        return None if (path / ".metadata").is_file() else f"{path / '.metadata'} is missing"
    for name, entry in meta["files"].items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{f} has {f.stat().st_size} bytes, the manifest says {entry['bytes']}"
    return None


def is_complete(path: Path) -> bool:
    return why_incomplete(path) is None


def file_names(meta: dict[str, Any]) -> list[str]:
    return sorted(meta.get("files", {}))


def verify(path: Path, meta: dict[str, Any], names: list[str]) -> list[str]:
    """Problems with the listed ``names`` (a share of the files), empty if intact."""
    problems = []
    for name in names:
        expected = meta["files"][name]
        f = path / name
        if not f.is_file():
            problems.append(f"{f} is missing")
            continue
        found = digest(f)
        if found["bytes"] != expected["bytes"]:
            problems.append(f"{f} has {found['bytes']} bytes, the manifest says {expected['bytes']}")
        elif found["sha256"] != expected["sha256"]:
            problems.append(f"{f} does not match its SHA-256 in the manifest (altered or corrupted)")
    return problems
