"""Checkpoint directories made in this process, without a process group or a model:
DCP's own files (``dcp.save(no_dist=True)``) and a format-3 manifest with every digest,
as ``write_checkpoint`` writes them. For the preflight and directory-protocol tests."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from fxpipe.checkpoint.files import step_dirname
from fxpipe.checkpoint.manifest import FORMAT, digest, with_digest

RUN_A, RUN_B = "a" * 16, "b" * 16


def schedule(step: int, lr: float = 2e-3) -> dict:
    """``fxpipe run``'s LambdaLR state after ``step`` steps, past its warm-up."""
    return {"base_lrs": [lr], "last_epoch": step, "_step_count": step + 1, "_is_initial": False,
            "_get_lr_called_within_step": False, "_last_lr": [lr], "lr_lambdas": [None]}


def make_checkpoint(root: Path, step: int, *, names: tuple[str, ...] = ("w",), source: str = "Toy",
                    run: str = RUN_A, extra: dict | None = None, pointer: bool = True) -> Path:
    path = root / step_dirname(step)
    with warnings.catch_warnings():  # DCP notes that it saves without a process group: intended
        warnings.simplefilter("ignore")
        dcp.save({f"model.{n}": torch.full((2,), float(step)) for n in names},
                 storage_writer=FileSystemWriter(path), no_dist=True)
    files = {f.name: digest(f) for f in sorted(path.iterdir())}
    meta = dict(format=FORMAT, step=step, extra={"lr_scheduler": schedule(step)} if extra is None else extra, world_size=1,
                mesh=dict(pp=1, dp=1, tp=1), source=source, precision="fp32", loss_scaler=None,
                state_dict={n: n for n in names}, torch=torch.__version__, run=run, files=files)
    (path / "fxpipe.json").write_text(json.dumps(with_digest(meta), indent=1))
    if pointer:
        (root / "latest").write_text(path.name + "\n")
    return path


def edit_manifest(path: Path, *, redigest: bool = False, **changes) -> None:
    """Change fields of ``path``'s manifest (nested: ``extra=...``), keeping its old digest
    unless ``redigest``."""
    f = path / "fxpipe.json"
    meta = json.loads(f.read_text())
    meta.update(changes)
    f.write_text(json.dumps(with_digest(meta) if redigest else meta))
