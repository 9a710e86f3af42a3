"""Every file and directory ``fxpipe run`` reads, registered once by identity.

An output is refused when it *is* an input or lies inside an input directory
(``job/output_paths.py``). Paths alone miss a hard link (``--metrics-file`` a second
name of the ``--data`` file appended JSON to the corpus) and a bind mount, so each input
is held by its ``(st_dev, st_ino)`` after links are resolved, and an output is compared
by the same identity: its own if it exists, and each existing directory above it. The
writers compare again on the descriptor they opened (``base/safe_io.open_output``'s
``forbidden``), so a name swapped between the check and the open is caught too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from fxpipe.base.hardware import PRESETS
from fxpipe.models.hf_dir import is_model_dir

if TYPE_CHECKING:
    from fxpipe.job.config import TrainConfig


@dataclass(frozen=True)
class Input:
    flag: str
    path: str
    identity: tuple[int, int]
    """(st_dev, st_ino) of what the path resolves to."""
    is_dir: bool


def identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``path`` with links followed; None if it does not exist."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def named_inputs(config: "TrainConfig", config_file: str | None = None) -> list[tuple[str, str | None]]:
    """(flag, path or None) of everything the run may read. ``--model`` counts when it is a
    directory; the tokenizer is the model directory's when none is given (inside it)."""
    hardware = config.parallel.hardware if config.parallel.hardware not in PRESETS else None
    costs = config.parallel.costs if config.parallel.costs not in ("measure", "model") else None
    model = config.model if is_model_dir(config.model) else None  # not a registry name's namesake file
    return [("--data", config.data), ("--val-data", config.val_data), ("--tokenizer", config.tokenizer),
            ("--config", config_file), ("--costs", costs), ("--hardware", hardware),
            ("--init-from", config.init_from), ("--model", model), ("--data-cache", config.data_cache)]


@dataclass(frozen=True)
class InputRegistry:
    inputs: tuple[Input, ...]

    @classmethod
    def of(cls, config: "TrainConfig", config_file: str | None = None) -> "InputRegistry":
        found = []
        for flag, path in named_inputs(config, config_file):
            ident = identity(path) if path is not None else None
            if ident is not None:  # a registry name, "measure", a cache still to be made
                found.append(Input(flag, str(path), ident, os.path.isdir(path)))
        return cls(tuple(found))

    def identities(self, *, besides: str | None = None) -> frozenset[tuple[int, int]]:
        """Every input's identity (except the input of flag ``besides``)."""
        return frozenset(i.identity for i in self.inputs if i.flag != besides)

    def clash(self, path: str | os.PathLike, *, besides: str | None = None) -> tuple[str, Input] | None:
        """("is", input) when ``path`` is an input (a link, a hard link or another
        spelling of it), ("inside", input) when it lies inside an input directory; None
        otherwise. ``besides``: the flag whose input this output is meant to be (the
        data cache is read and written)."""
        others = [i for i in self.inputs if i.flag != besides]
        own = identity(path)
        for i in others:
            if own == i.identity:
                return "is", i
        for above in _existing_parents(Path(path)):
            for i in others:
                if i.is_dir and above == i.identity:
                    return "inside", i
        return None


def _existing_parents(path: Path) -> Iterator[tuple[int, int]]:
    """Identities of the directories above ``path`` that exist, nearest first (links and
    ``..`` resolved as the writer's open will resolve them)."""
    real = Path(os.path.realpath(path))
    for parent in real.parents:
        ident = identity(parent)
        if ident is not None:
            yield ident
