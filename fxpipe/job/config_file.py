"""``fxpipe run --config run.toml``: the same keys as the flags, read with ``tomllib``.

Keys are the flags' names without dashes in front (``micro-batch-size = 4``,
``lr-schedule = "cosine"``), flat or under a ``[run]`` table; a key that is not a
flag is refused, listing the valid ones. Values pass through the flag's own parser,
so a file cannot hold what the command line would refuse. Flags given on the
command line override the file; the file overrides the dataclass defaults.

``to_toml`` writes the resolved config in the same form: printed at start and saved
beside the checkpoints (``fxpipe-run.toml``), it runs again with ``--config``.
"""
from __future__ import annotations

import argparse
import enum
import tomllib
from typing import Any, Mapping

from fxpipe.base.safe_io import read_bounded
from fxpipe.job.config import TrainConfig
from fxpipe.job.flags import LAYOUT_FLAGS, TRAIN_FLAGS, Flag, Kind, optional_path

MAX_CONFIG_BYTES = 1 << 20
SAVED_NAME = "fxpipe-run.toml"
"""The resolved config's file name in --checkpoint-dir."""


def read_config(path: str, flags: Mapping[str, "Flag"]) -> dict[str, Any]:
    """Field name -> value of a TOML file whose keys are ``flags``' names."""
    try:
        doc = tomllib.loads(read_bounded(path, MAX_CONFIG_BYTES).decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--config {path}: not TOML ({exc})") from None
    if set(doc) == {"run"} and isinstance(doc["run"], dict):
        doc = doc["run"]
    by_key = {f.key: f for f in flags.values()}
    unknown = sorted(k for k in doc if k not in by_key)
    if unknown:
        raise ValueError(f"--config {path}: unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; valid keys: {', '.join(sorted(by_key))}")
    return {by_key[k].field: _value(path, by_key[k], v) for k, v in doc.items()}


def _value(path: str, flag: "Flag", value: Any) -> Any:

    where = f"--config {path}: {flag.key}"
    if flag.kind is not Kind.VALUE:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value

    text = flag.type in (str, optional_path)
    if isinstance(value, (dict, list, bool)) or isinstance(value, str) != text:
        raise ValueError(f"{where} must be {'a string' if text else 'a number'}, got {value!r}")
    try:
        parsed = flag.type(str(value)) if flag.type is not None else value
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if flag.choices is not None and parsed not in flag.choices:
        raise ValueError(f"{where} must be one of {', '.join(map(str, flag.choices))}, got {value!r}")
    return parsed


def _toml_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


ONE_TIME = frozenset({"resume_from", "overwrite"})
"""Fields that describe one launch, not the run: a saved config replayed later must not
resume from the step this launch began at again (skipping the newer checkpoints), nor
overwrite the directory it saves into."""


def to_toml(config: "TrainConfig") -> str:
    """The resolved run config as TOML with the flags' keys (None fields left out: their
    default is None, but for files on by default, written as "none")."""

    lines = []
    for flags, obj in ((TRAIN_FLAGS, config), (LAYOUT_FLAGS, config.parallel)):
        for name, flag in flags.items():
            if name in ONE_TIME:
                continue
            value = getattr(obj, name)
            if value is None and flag.type is optional_path:
                value = "none"  # a file that is on by default, turned off
            elif value is None:
                continue
            if flag.kind is Kind.NEGATED:
                value = bool(value)
            lines.append(f"{flag.key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"

