"""A layout search's result, remembered on disk so the next run of the same job starts at once.

The key is everything the search's answer depends on: the captured graph (its code, its
parameters' names, shapes and dtypes), the batch's shapes and dtypes, the world, the
threads and cores the ranks time-share, the hardware profile (its values, not its name),
every field of the base config (the pins among them), the pins, and fxpipe's version. A
change to any of them is another file.

The file is untrusted input — another user, a truncated write, an older fxpipe may have
left it: JSON only (never pickle), every field checked against its schema, the content's
digest verified, and the layout it names rebuilt through ``ParallelConfig`` (whose rules
refuse what cannot be a layout) and checked against the world, the batch and the pins.
Anything wrong and the file is ignored with a warning, and the search runs again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import fxpipe
from fxpipe.base.hardware import get_hardware
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import Program
from fxpipe.schedules.registry import ScheduleKind

SCHEMA = 1
_INT_FIELDS = ("tp", "pp", "dp", "num_microbatches", "chunks", "ep", "zero")
_BOOL_FIELDS = ("vocab_passes", "split_loss", "sp")
_ROW_FLOATS = ("step_s", "bubble", "allreduce_s")
_MAX_ROWS = 64
"""Layouts kept per search: the table's leading rows (the choice first)."""


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def cache_dir() -> Path:
    """``$FXPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxpipe``, else ``~/.cache/fxpipe``; layouts under it."""
    root = os.environ.get("FXPIPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fxpipe")
    return Path(root) / "layouts"


PRICE_REVISION = 2
"""Raised whenever the price of a layout changes for the same graph, batch and hardware
(2: each shape's group times add up to its graph timed whole, ``costs.measure.fit_to_whole``):
a search remembered under the old price is searched again."""


def search_key(program: Program, batch_specs: list, world: int, base: ParallelConfig,
               pinned: Mapping[str, Any], threads: int | None, concurrent: int | None) -> dict[str, Any]:
    """What the search's answer depends on (module docstring), as plain JSON values."""
    params = sorted((p.canonical, list(p.shape), str(p.dtype)) for p in program.params)
    graph = hashlib.sha256(program.graph_module.code.encode()).hexdigest()
    try:
        hardware = _digest(dataclasses.asdict(get_hardware(base.hardware)))
    except (ValueError, OSError):
        hardware = base.hardware
    key = {"graph": _digest([graph, params]), "batch": [[list(s), d] for s, d in batch_specs],
            "world": world, "hardware": hardware, "base": repr(base),
            "pinned": sorted((k, repr(v)) for k, v in pinned.items()), "threads": threads,
            "concurrent": concurrent, "fxpipe": fxpipe.__version__, "price": PRICE_REVISION}
    return json.loads(json.dumps(key))  # as it reads back: tuples are lists in JSON


def _layout_fields(config: ParallelConfig) -> dict[str, Any]:
    fields = {f: getattr(config, f) for f in _INT_FIELDS + _BOOL_FIELDS}
    return {**fields, "schedule": config.schedule.value, "recompute": config.recompute.value}


def _config_from(fields: Any, base: ParallelConfig) -> ParallelConfig:
    """The layout a cached row names, rebuilt through ``ParallelConfig``'s own checks."""
    expected = set(_INT_FIELDS + _BOOL_FIELDS) | {"schedule", "recompute"}
    if not isinstance(fields, dict) or set(fields) != expected:
        raise ValueError("layout fields missing or unknown")
    for f in _INT_FIELDS:
        if type(fields[f]) is not int or not 0 <= fields[f] <= 1 << 20:
            raise ValueError(f"{f} is not a small non-negative integer")
    for f in _BOOL_FIELDS:
        if type(fields[f]) is not bool:
            raise ValueError(f"{f} is not a boolean")
    if not isinstance(fields["schedule"], str) or not isinstance(fields["recompute"], str):
        raise ValueError("schedule/recompute are not names")
    return dataclasses.replace(base, **{f: fields[f] for f in _INT_FIELDS + _BOOL_FIELDS},
                               schedule=ScheduleKind.parse(fields["schedule"]),
                               recompute=RecomputeMode(fields["recompute"]))


def save(path: Path, key: dict[str, Any], found: Any) -> None:
    """Write ``found`` (a ``LayoutSearch``) under ``key``; a failure to write only warns."""
    rows = [{"layout": _layout_fields(p.config), "memory_bytes": int(p.memory_bytes),
             **{f: float(getattr(p, f)) for f in _ROW_FLOATS}} for p in found.ranked[:_MAX_ROWS]]
    body = {"schema": SCHEMA, "key": key, "rows": rows, "seconds": float(found.seconds), "costs": found.costs,
            "priced": len(found.ranked), "refused": len(found.refused), "pruned": int(found.pruned)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**body, "digest": _digest(body)}))
        os.replace(tmp, path)  # whole or not at all: a reader never sees half a file
    except OSError as exc:
        warnings.warn(f"fxpipe: could not save the layout search to {path}: {exc}", stacklevel=2)


def load(path: Path, key: dict[str, Any], base: ParallelConfig) -> tuple[list, dict[str, Any]] | None:
    """The cached rows under ``key`` as (config, memory_bytes, step_s, bubble, allreduce_s)
    tuples, and the file's body; None when there is no file, or (with a warning) when it is
    not a valid cache of this key (module docstring)."""
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > 4 << 20:
            raise ValueError("larger than any search's cache")
        body = json.loads(path.read_text())
        if not isinstance(body, dict) or body.get("schema") != SCHEMA:
            raise ValueError("not a layout cache of this schema")
        digest = body.pop("digest", None)
        if digest != _digest(body):
            raise ValueError("its digest does not match its content")
        if body.get("key") != key:
            raise ValueError("it was written for another search")
        rows = body.get("rows")
        if not isinstance(rows, list) or not 1 <= len(rows) <= _MAX_ROWS:
            raise ValueError("no layouts")
        out = []
        for row in rows:
            if not isinstance(row, dict) or set(row) != {"layout", "memory_bytes", *_ROW_FLOATS}:
                raise ValueError("a row's fields are missing or unknown")
            if type(row["memory_bytes"]) is not int or row["memory_bytes"] < 0:
                raise ValueError("a row's memory is not a byte count")
            values = [row[f] for f in _ROW_FLOATS]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6 for v in values):
                raise ValueError("a row's times are not seconds")
            out.append((_config_from(row["layout"], base), row["memory_bytes"], *map(float, values)))
        for f, kind in (("seconds", (int, float)), ("costs", str), ("priced", int), ("refused", int), ("pruned", int)):
            if not isinstance(body.get(f), kind) or isinstance(body.get(f), bool):
                raise ValueError(f"{f} is missing or of the wrong type")
        return out, body
    except (ValueError, TypeError, KeyError, OSError, RecursionError) as exc:
        warnings.warn(f"fxpipe: ignoring the layout search cache {path} ({exc}); searching again", stacklevel=2)
        return None
