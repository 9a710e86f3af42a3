"""Every input ``fxpipe run`` registers (``job/input_registry.py``), one case each: a file
input is found again through a hard link and a symbolic link, a directory input holds
what lies inside it (through a linked parent too), and nothing else clashes. The
command-line cases for each flag are in tests/job/test_input_registry.py."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from fxpipe.job.config import TrainConfig
from fxpipe.job.input_registry import InputRegistry, named_inputs

FILE_INPUTS = ["--data", "--val-data", "--tokenizer", "--config", "--costs", "--hardware"]
DIR_INPUTS = ["--init-from", "--model", "--data-cache"]


def _config(flag: str, path) -> tuple[TrainConfig, str | None]:
    """A run whose ``flag`` reads ``path`` (the config file is given beside the config)."""
    path = str(path)
    if flag == "--config":
        return TrainConfig(), path
    if flag in ("--costs", "--hardware"):
        field = flag[2:]
        return TrainConfig(parallel=dataclasses.replace(TrainConfig().parallel, **{field: path})), None
    field = {"--data": "data", "--val-data": "val_data", "--tokenizer": "tokenizer", "--init-from": "init_from",
             "--model": "model", "--data-cache": "data_cache"}[flag]
    return TrainConfig(**{field: path}), None


def test_the_sweep_covers_every_registered_flag():
    assert {flag for flag, _ in named_inputs(TrainConfig(), "x.toml")} == set(FILE_INPUTS + DIR_INPUTS)


@pytest.mark.parametrize("flag", FILE_INPUTS)
def test_a_file_input_is_found_by_identity(tmp_path, flag):
    victim = tmp_path / "input"
    victim.write_text("precious\n")
    registry = InputRegistry.of(*_config(flag, victim))
    os.link(victim, tmp_path / "hard")
    (tmp_path / "soft").symlink_to(victim)
    for name in ("input", "hard", "soft"):
        kind, found = registry.clash(tmp_path / name)
        assert (kind, found.flag, found.path) == ("is", flag, str(victim)), name
    assert registry.clash(tmp_path / "elsewhere") is None
    assert registry.clash(tmp_path / "input", besides=flag) is None


@pytest.mark.parametrize("flag", DIR_INPUTS)
def test_a_directory_input_holds_what_lies_inside_it(tmp_path, flag):
    directory = tmp_path / "dir"
    directory.mkdir()
    if flag == "--model":  # a model directory is one with a config.json
        (directory / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    registry = InputRegistry.of(*_config(flag, directory))
    (tmp_path / "link").symlink_to(directory)
    assert registry.clash(directory)[0] == "is"
    for inside in (directory / "out.json", directory / "new" / "deeper.json", tmp_path / "link" / "out.json"):
        kind, found = registry.clash(inside)
        assert (kind, found.flag) == ("inside", flag), inside
    assert registry.clash(tmp_path / "beside.json") is None
