"""What the checkpoint fault tests share: one-process children driving the directory
protocol (tests/checkpoint/_ckpt_child.py) and the checks of what they leave."""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fxpipe.checkpoint.dcp import candidates, local_problems, pick_intact
from fxpipe.checkpoint.files import SafeReader
from tests.checkpoint._ckpt_child import state

ROOT = Path(__file__).resolve().parents[2]


def child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.checkpoint._ckpt_child", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_child(*args: str) -> str:
    proc = child(*args)
    # A guard against a hang, not a time limit: at a load of 30 on 2 cores a child that
    # imports torch and saves 2 MB took over 120 s (the limit it had, which it failed by).
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return out.strip()


def loads_its_step(path: Path) -> None:
    """Intact, and DCP reads back exactly the tensors of its step."""
    assert local_problems(path) == [], path
    step = int(path.name.split("_")[1])
    expected = state(step)
    targets = {k: torch.empty_like(v) for k, v in expected.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=SafeReader(path), no_dist=True)
    for k, v in expected.items():
        assert torch.equal(targets[k], v), (path, k)


def resume_choice(root: Path, step: int | None = None) -> tuple[Path, list[str]]:
    """What load_checkpoint picks and the notes of its warning (the same functions, one
    process checking every file)."""
    paths, notes = candidates(root, step)
    return pick_intact(paths, local_problems, strict=step is not None, notes=notes)
