"""``fxpipe run``'s outputs never land on a file the run reads, inside an input directory, on one
another or through a link; a refusal leaves every input as it was, and the writers themselves do
not follow a link made after the check."""
from __future__ import annotations

from pathlib import Path

import pytest

from fxpipe.base.safe_io import UnsafeFileError

from tests.job._cli import RUN, refused


def _corpus(tmp_path: Path) -> Path:
    from tests.data._corpus import write_corpus

    write_corpus(tmp_path / "texts", docs=20, words=200)
    return tmp_path / "texts"


@pytest.mark.parametrize("output", ["--metrics-file", "--export"])
def test_an_output_on_the_data_file_is_refused_and_the_data_kept(tmp_path, monkeypatch, capsys, output):
    data = _corpus(tmp_path) / "a.txt"
    before = data.read_bytes()
    refused(RUN + ["--data", data, output, data], monkeypatch, capsys,
             f"{output} {data} is what --data reads", "choose another path")
    assert data.read_bytes() == before


def test_an_output_inside_the_data_directory_is_refused(tmp_path, monkeypatch, capsys):
    texts = _corpus(tmp_path)
    refused(RUN + ["--data", texts, "--metrics-file", texts / "m.jsonl"], monkeypatch, capsys,
             f"--metrics-file {texts}/m.jsonl lies inside {texts}, the directory --data reads")
    assert not (texts / "m.jsonl").exists()


def test_export_into_the_init_from_directory_is_refused_and_the_weights_kept(tmp_path, monkeypatch, capsys):
    from tests.job._cli import hf_weights

    d = hf_weights(tmp_path)
    before = (d / "model.safetensors").read_bytes()
    refused(RUN + ["--init-from", d, "--export", d], monkeypatch, capsys, f"--export {d} is what --init-from reads")
    assert (d / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("flag, suffix", [("--metrics-file", ""), ("--timeline", ".json")])
def test_an_output_that_is_a_link_is_refused_and_its_target_kept(tmp_path, monkeypatch, capsys, flag, suffix):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / f"out{suffix}").symlink_to(victim)
    refused(RUN + [flag, tmp_path / "out"], monkeypatch, capsys, f"{tmp_path}/out{suffix} is a symbolic link",
             "writes no output through a link")
    assert victim.read_text() == "precious\n"


def test_two_outputs_on_one_path_are_refused(tmp_path, monkeypatch, capsys):
    refused(RUN + ["--metrics-file", tmp_path / "x.json", "--timeline", tmp_path / "x"], monkeypatch, capsys,
             "is also where --metrics-file writes")


def test_the_writers_do_not_follow_a_link_made_after_the_check(tmp_path):
    from fxpipe.base.safe_io import open_output
    from fxpipe.job.metrics import MetricsWriter

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "m.jsonl").symlink_to(victim)
    with pytest.raises(UnsafeFileError, match="m.jsonl is a symbolic link"):
        MetricsWriter(str(tmp_path / "m.jsonl"), None)
    with pytest.raises(UnsafeFileError, match="is a FIFO"):
        import os
        os.mkfifo(tmp_path / "fifo")
        open_output(tmp_path / "fifo")
    assert victim.read_text() == "precious\n"
    with open_output(tmp_path / "new.txt") as f:  # a plain file is written, and truncated when rewritten
        f.write("a long first line\n")
    with open_output(tmp_path / "new.txt") as f:
        f.write("b\n")
    assert (tmp_path / "new.txt").read_text() == "b\n"
