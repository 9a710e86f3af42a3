"""Files the user names to ``fxpipe run`` and ``fxpipe compile`` (hardware profiles, weights,
metrics) must be regular files: a device or a FIFO is refused at once, never read or waited on."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.job._cli import RUN, refused


def _fifo(path: Path) -> Path:
    import os
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("make, kind", [(lambda p: p.symlink_to("/dev/zero"), "a character device"),
                                        (_fifo, "a FIFO")], ids=["dev-zero", "fifo"])
def test_a_hardware_profile_that_is_not_a_file_is_refused_at_once(tmp_path, capsys, make, kind):
    from fxpipe import cli

    make(tmp_path / "hw.json")
    code = cli.main(["plan", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch", "8",
                     "--hardware", str(tmp_path / "hw.json")])
    err = capsys.readouterr().err
    assert code == 2 and f"hw.json is {kind}, not a regular file" in err and "Traceback" not in err, err


def test_a_weights_file_that_is_a_fifo_is_refused_without_waiting(tmp_path, monkeypatch, capsys):
    (tmp_path / "hf").mkdir()
    _fifo(tmp_path / "hf" / "model.safetensors")
    refused(RUN + ["--init-from", tmp_path / "hf"], monkeypatch, capsys, "model.safetensors is a FIFO")


def test_a_metrics_file_that_is_a_fifo_is_refused_before_workers(tmp_path, monkeypatch, capsys):
    refused(RUN + ["--metrics-file", _fifo(tmp_path / "m.jsonl")], monkeypatch, capsys,
             "--metrics-file", "m.jsonl is a FIFO, not a regular file")


@pytest.mark.parametrize("command", ["run", "compile"])
def test_a_hardware_profile_that_is_a_device_is_refused_by_run_and_compile(tmp_path, monkeypatch, capsys, command):
    (tmp_path / "hw.json").symlink_to("/dev/zero")
    argv = (RUN if command == "run" else ["compile", "--model", "gpt-tiny", "--seq", "16", "--batch", "4",
                                          "--pp", "2", "--costs", "model"]) + ["--hardware", tmp_path / "hw.json"]
    refused(argv, monkeypatch, capsys, "hw.json is a character device, not a regular file")
