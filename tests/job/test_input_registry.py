"""Every file a run reads is registered once and every output is
checked against it by identity (device and inode), before any worker starts, and again
on the descriptor a writer opened. Each case runs ``fxpipe.cli.main`` in this process
with the launcher replaced by a function that fails the test, and asserts the message,
the exit code and the input's bytes."""
from __future__ import annotations

import os

import pytest

from fxpipe.base.safe_io import UnsafeFileError, open_output
from tests.job._cli import RUN, refused


@pytest.fixture
def corpus(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    return data


@pytest.mark.parametrize("input_flag", ["--data", "--val-data", "--tokenizer"])
def test_a_metrics_file_that_is_a_hard_link_to_an_input_is_refused_and_the_input_kept(
        tmp_path, monkeypatch, capsys, corpus, input_flag):
    victim = corpus if input_flag == "--data" else tmp_path / "victim"
    if victim != corpus:
        victim.write_bytes(b"precious\n")
    os.link(victim, tmp_path / "m.jsonl")
    before = victim.read_bytes()
    extra = [] if input_flag == "--data" else [input_flag, victim]
    refused(RUN + ["--data", corpus, *extra, "--metrics-file", tmp_path / "m.jsonl"], monkeypatch, capsys,
             f"--metrics-file {tmp_path}/m.jsonl is what {input_flag} reads ({victim})",
             "the same file by another name: a hard link", "choose another path")
    assert victim.read_bytes() == before


@pytest.mark.parametrize("output", ["--metrics-file", "--export"])
def test_an_output_on_the_validation_data_is_refused(tmp_path, monkeypatch, capsys, corpus, output):
    val = tmp_path / "val.txt"
    val.write_text("held out\n" * 50)
    refused(RUN + ["--data", corpus, "--val-data", val, "--eval-interval", "1", output, val], monkeypatch, capsys,
             f"{output} {val} is what --val-data reads")
    assert val.read_text() == "held out\n" * 50


def test_a_metrics_file_on_the_config_file_is_refused(tmp_path, monkeypatch, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('lr = 0.001\n')
    refused(RUN + ["--config", toml, "--metrics-file", toml], monkeypatch, capsys,
             f"--metrics-file {toml} is what --config reads")
    assert toml.read_text() == 'lr = 0.001\n'


def test_a_data_cache_inside_the_data_directory_or_on_the_data_is_refused(tmp_path, monkeypatch, capsys, corpus):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("words " * 100)
    refused(RUN + ["--data", texts, "--data-cache", texts / "cache"], monkeypatch, capsys,
             f"--data-cache {texts}/cache lies inside {texts}, the directory --data reads")
    refused(RUN + ["--data", corpus, "--data-cache", corpus], monkeypatch, capsys,
             f"--data-cache {corpus} is what --data reads")
    # an output inside the data cache (an input too) is refused; the cache itself is no clash
    (tmp_path / "cache").mkdir()
    refused(RUN + ["--data", corpus, "--data-cache", tmp_path / "cache", "--metrics-file", tmp_path / "cache" / "m"],
             monkeypatch, capsys, "lies inside", "the directory --data-cache reads")


def test_an_output_inside_an_input_reached_through_a_linked_parent_is_refused(tmp_path, monkeypatch, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("words " * 100)
    (tmp_path / "alias").symlink_to(texts)
    refused(RUN + ["--data", texts, "--metrics-file", tmp_path / "alias" / "m.jsonl"], monkeypatch, capsys,
             f"lies inside {texts}, the directory --data reads")
    assert sorted(p.name for p in texts.iterdir()) == ["a.txt"]


def test_a_writer_refuses_an_input_on_its_opened_descriptor_before_truncating(tmp_path):
    """A name swapped after the launcher's check (here: a hard link made afterwards) is
    caught by the writer's fstat, before a byte is truncated or appended."""
    data = tmp_path / "data.txt"
    data.write_bytes(b"corpus\n")
    st = os.stat(data)
    os.link(data, tmp_path / "out.json")
    for append in (False, True):
        with pytest.raises(UnsafeFileError, match="is a file this run reads"):
            open_output(tmp_path / "out.json", append=append, forbidden=frozenset({(st.st_dev, st.st_ino)}))
    assert data.read_bytes() == b"corpus\n"
    with open_output(tmp_path / "new.json", forbidden=frozenset({(st.st_dev, st.st_ino)})) as f:
        f.write("ok")
    assert (tmp_path / "new.json").read_text() == "ok"
