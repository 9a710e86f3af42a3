"""``fxpipe.json``: the manifest of a checkpoint, read as hostile input.

It is JSON (never pickled) and lists every file of the checkpoint with its size and
SHA-256 (``files``), besides the step, the layout and the state_dict names. A
checkpoint is complete only if every listed file is present at its size
(``is_complete``, cheap: a stat per file) and intact only if every digest matches
(``verify``, reads every byte; in a job the ranks share the files between them).

Format 3 also covers the manifest's own content with a digest (``sha256``: SHA-256 of
the canonical JSON of every other field), so ``extra`` (the LR scheduler's state),
the loss scaler and the names are as trusted as the tensors: an edited field makes
the checkpoint corrupt, and a resume falls back to an intact one. It also records
the ``run`` that saved it (a random id a fresh run draws and a resume inherits), so
pruning deletes only its own run's checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from fxpipe.base.safe_io import UnsafeFileError, check_regular, open_regular, read_bounded

FORMAT = 3
"""3: the manifest's own digest and its run. 2: ``files`` with digests (the manifest
itself unverified). Format-1 checkpoints (no digests) still load, unverified."""
READABLE = (1, 2, FORMAT)
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
    with open(open_regular(path, follow=False), "rb") as f:  # never through a link, never a FIFO
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
    # fp16's loss scaler (runtime/mixed_precision.py), restored field by field on load.
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
_RUN = re.compile(r"^[0-9a-f]{8,64}$")
_SELF_CHECK = {"run": lambda v: isinstance(v, str) and bool(_RUN.match(v)),
               "sha256": lambda v: isinstance(v, str) and bool(_HEX64.match(v))}
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
        meta = json.loads(read_bounded(f, MAX_MANIFEST_BYTES, follow=False).decode("utf-8"),
                          parse_constant=_refuse_constant)
    except UnsafeFileError as exc:
        raise CorruptCheckpointError(str(exc)) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(f"{f} is not readable JSON ({type(exc).__name__}: "
                                     f"{str(exc)[:200]})") from None
    if not isinstance(meta, dict):
        _fail(path, "is not a JSON object")
    fmt = meta.get("format")
    if type(fmt) is not int or fmt not in READABLE:
        _fail(path, f"has format {str(fmt)[:32]!r}; this fxpipe reads {', '.join(map(str, READABLE))}")
    checks = {**_CHECKS, **(_FILES_CHECK if fmt >= 2 else {}), **(_SELF_CHECK if fmt >= 3 else {})}
    for key, ok in checks.items():
        if key not in meta or not ok(meta[key]):
            _fail(path, f"field {key!r} is missing or malformed")
    if meta["mesh"]["pp"] * meta["mesh"]["dp"] * meta["mesh"]["tp"] != meta["world_size"]:
        _fail(path, f"mesh {meta['mesh']} does not multiply to its world size {meta['world_size']}")
    named = re.match(r"^step_(\d+)$", path.name)
    if named and int(named.group(1)) != meta["step"]:
        _fail(path, f"says step {meta['step']}, but it is in {path.name}")
    if fmt >= 3 and self_digest(meta) != meta["sha256"]:  # last: a malformed field is named above
        _fail(path, "does not match its own SHA-256 (a field, e.g. extra, was edited or corrupted)")
    return meta


def self_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON without its ``sha256`` field. Python's
    float repr round-trips, so a parsed manifest gives back the digest it was written with."""
    body = json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def with_digest(meta: dict[str, Any]) -> dict[str, Any]:
    return {**meta, "sha256": self_digest(meta)}


def why_incomplete(path: Path) -> str | None:
    """None if every file the manifest lists is present at its recorded size (format 2),
    or DCP's index and the manifest exist (format 1); else what is wrong, naming the file."""
    try:
        meta = read_manifest(path)
    except CorruptCheckpointError as exc:
        return str(exc)
    listed = {".metadata": None} if meta["format"] == 1 else meta["files"]
    for name, entry in listed.items():
        f = path / name
        try:  # lstat: a listed file that is a link (out of the directory) is not the checkpoint's
            size = check_regular(f, follow=False).st_size
        except FileNotFoundError:
            return f"{f} is missing"
        except (UnsafeFileError, OSError) as exc:
            return str(exc)
        if entry is not None and size != entry["bytes"]:
            return f"{f} has {size} bytes, the manifest says {entry['bytes']}"
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
        try:
            found = digest(f)
        except FileNotFoundError:
            problems.append(f"{f} is missing")
            continue
        except (UnsafeFileError, OSError) as exc:
            problems.append(str(exc))
            continue
        if found["bytes"] != expected["bytes"]:
            problems.append(f"{f} has {found['bytes']} bytes, the manifest says {expected['bytes']}")
        elif found["sha256"] != expected["sha256"]:
            problems.append(f"{f} does not match its SHA-256 in the manifest (altered or corrupted)")
    return problems
