"""``fxpipe run`` through ``fxpipe.cli.main`` in this process, for the tests of its
refusals: the launcher is replaced by a function that fails the test when the input
should have been refused before any worker (``refused``), or that records the config the
workers would get (``launched``)."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

import fxpipe.job.launcher
from fxpipe import cli
from fxpipe.models import build_workload

RUN = ["run", "--model", "gpt-tiny", "--seq", "16", "--tp", "1", "--pp", "2", "--steps", "2",
       "--timeline", "none", "--micro-batch-size", "2", "--microbatches", "2", "--costs", "model"]
TINY_NAMES = tuple(build_workload("gpt-tiny", batch=1, seq=8).model.state_dict())
"""gpt-tiny's state dict names: what a checkpoint of it holds."""


def _spawned(*args, **kwargs):
    raise AssertionError("a worker was spawned although the launcher could have refused the input")


def refused(argv: list, monkeypatch, capsys, *expected: str) -> str:
    """Exit code 2, one line, every ``expected`` piece in it, no worker."""
    monkeypatch.setattr(fxpipe.job.launcher, "launch", _spawned)
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for piece in expected:
        assert piece in err, f"{piece!r} not in: {err}"
    return err


def launched(argv: list, monkeypatch, capsys):
    """The preflight passes: the config the workers would be started with."""
    seen = []
    monkeypatch.setattr(fxpipe.job.launcher, "launch", lambda config, debug=False: seen.append(config) or 0)
    code = cli.main([str(a) for a in argv])
    assert code == 0, capsys.readouterr().err
    return seen[0]


def snapshot(root: Path) -> dict:
    """Every file under ``root`` and its bytes: what a refusal must leave as it was."""
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def hf_weights(tmp_path: Path, **changes) -> Path:
    """gpt-tiny's state dict as save_pretrained writes it (the tied lm_head stored once)."""
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    sd = {k: v.clone() for k, v in build_workload("gpt-tiny", batch=1, seq=8).model.state_dict().items()
          if k != "lm_head.weight"}
    sd.update(changes)
    save_file(sd, d / "model.safetensors")
    return d
