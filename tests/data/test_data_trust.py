"""The data path: nothing silent, nothing half-written. An
unwritable cache is refused naming the path and errno (or, beside read-only data, said
aloud); a manifest's numbers are range-checked; a corpus of empty rows, a directory of
Parquet and text, a dataset directory holding a link are refused; SIGTERM during
``prepare-data`` removes its temporary file and says so. All in this process."""
from __future__ import annotations

import json
import os
import re
import signal

import pytest

from fxpipe import cli
from fxpipe.data import ByteTokenizer
from fxpipe.data.corpus import open_corpus, tokenized
from tests.data._corpus import write_corpus


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": rows}), path)


@pytest.mark.parametrize("where", ["a file", "under a file", "/proc", "the data file"])
def test_prepare_data_refuses_a_cache_it_cannot_write_naming_path_and_errno(tmp_path, capsys, where):
    write_corpus(tmp_path / "texts")
    (tmp_path / "f").write_text("x")
    data = tmp_path / "texts" / "a.txt" if where == "the data file" else tmp_path / "texts"
    kept = (tmp_path / "texts" / "a.txt").read_bytes()
    cache = {"a file": tmp_path / "f", "under a file": tmp_path / "f" / "sub", "/proc": "/proc/fxpipe-cache",
             "the data file": data}[where]
    assert cli.main(["prepare-data", str(data), "--data-cache", str(cache), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--data-cache {cache}" in err and "the token cache cannot be written there (" in err, err
    assert any(name in err for name in ("EEXIST", "ENOTDIR", "ENOENT", "EACCES", "EROFS")), err
    assert (tmp_path / "f").read_text() == "x" and (tmp_path / "texts" / "a.txt").read_bytes() == kept


def test_read_only_data_without_a_cache_dir_is_tokenized_in_memory_and_said_so(tmp_path, capsys, monkeypatch):
    write_corpus(tmp_path / "texts")
    import fxpipe.data.corpus as corpus

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(corpus, "CacheWriter", refuse)  # as a read-only directory answers (root writes anywhere)
    stream, _ = tokenized(open_corpus(tmp_path / "texts"), ByteTokenizer())
    assert len(stream.tokens) > 0
    err = capsys.readouterr().err
    assert "cannot be written beside it" in err and "EACCES: Permission denied" in err and "--data-cache DIR" in err


@pytest.mark.parametrize("field, value", [("largest", -1), ("documents", -5), ("documents", 0), ("largest", 10**9)])
def test_a_manifest_out_of_range_is_no_cache(tmp_path, field, value):
    write_corpus(tmp_path / "texts")
    _, cache = tokenized(open_corpus(tmp_path / "texts"), ByteTokenizer())
    manifest = cache.with_suffix(".json")
    doc = json.loads(manifest.read_text())
    doc[field] = value
    manifest.write_text(json.dumps(doc))
    from fxpipe.data.token_cache import open_cache

    assert open_cache(cache.with_suffix(""), "texts") is None


def test_a_dataset_of_empty_rows_is_refused(tmp_path):
    _parquet(tmp_path / "empty.parquet", ["", "", ""])
    with pytest.raises(ValueError, match=r"empty.parquet holds 3 documents but no tokens besides their end-of-text "
                                         r"markers"):
        tokenized(open_corpus(tmp_path / "empty.parquet"), ByteTokenizer())


def test_a_directory_of_parquet_and_text_is_refused_not_half_read(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    _parquet(d / "a.parquet", ["some rows of text"])
    (d / "b.txt").write_text("text that would have been dropped")
    with pytest.raises(ValueError, match=r"holds dataset files \(a.parquet\) and text files \(b.txt\); fxpipe reads "
                                         r"a directory as one or the other, never half of it"):
        open_corpus(d)


def test_a_dataset_directory_holding_a_link_is_refused_naming_it(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    _parquet(tmp_path / "outside.parquet", ["secret"])
    _parquet(d / "a.parquet", ["rows"])
    (d / "b.parquet").symlink_to(tmp_path / "outside.parquet")
    with pytest.raises(ValueError, match=r"the dataset directory holds symbolic links \(b.parquet\)"):
        open_corpus(d)


def test_sigterm_during_prepare_data_removes_the_temporary_file_and_says_so(tmp_path, capsys, monkeypatch):
    from fxpipe.data import token_cache

    write_corpus(tmp_path / "texts", docs=40, words=300)
    append = token_cache.CacheWriter.append

    def append_then_term(self, ids):
        append(self, ids)
        assert self.tmp.exists()
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill` would, mid-write

    monkeypatch.setattr(token_cache.CacheWriter, "append", append_then_term)
    code = cli.main(["prepare-data", str(tmp_path / "texts"), "--workers", "1", "--quiet"])
    assert code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM; the partial token cache was removed" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], list(tmp_path.iterdir())
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the handler is put back"


def test_peak_tflops_out_of_range_is_refused(monkeypatch, capsys):
    from tests.job._cli import RUN, refused

    refused(RUN + ["--peak-tflops", "1e-300"], monkeypatch, capsys,
             "--peak-tflops must be a device's peak in [0.001, 100000] TFLOP/s, got 1e-300")


def test_an_edit_between_the_sampled_bytes_is_announced_and_caught_by_verify(tmp_path, capsys, monkeypatch):
    """The cache key samples each file (size, mtime and a few blocks): an edit between the
    samples that restores size and mtime finds the old cache — said where it is found —
    and ``prepare-data --verify`` re-reads every byte and replaces the stale cache."""
    from fxpipe.data import token_cache

    monkeypatch.setattr(token_cache, "SAMPLE", 16)  # small samples: a small file has gaps between them
    monkeypatch.setattr(token_cache, "SAMPLES", 2)
    text = tmp_path / "a.txt"
    text.write_text("abcdefgh " * 400)
    argv = ["prepare-data", str(text), "--workers", "1", "--quiet"]
    assert cli.main(argv) == 0
    st = text.stat()
    edited = bytearray(text.read_bytes())
    edited[1000:1003] = b"XYZ"  # between the samples at 0, ~1184 and the end
    text.write_bytes(bytes(edited))
    os.utime(text, ns=(st.st_atime_ns, st.st_mtime_ns))
    capsys.readouterr()
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert ": found " in out and "found by the files' sizes, mtimes and sampled bytes, not every byte; --verify" in out
    assert cli.main(argv + ["--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified every byte: the cache found was stale (its blocks differ) and was replaced" in out, out
    stream, _ = tokenized(open_corpus(text), ByteTokenizer())
    assert bytes(stream.read(1000, 1003).astype("uint8")) == b"XYZ"
    assert cli.main(argv + ["--verify"]) == 0
    assert "verified every byte: the cache matched" in capsys.readouterr().out


def test_run_refuses_an_unwritable_data_cache_before_workers(tmp_path, monkeypatch, capsys):
    from tests.job._cli import RUN, refused

    write_corpus(tmp_path / "texts")
    refused(RUN + ["--data", tmp_path / "texts", "--data-cache", "/proc/fxpipe-cache"], monkeypatch, capsys,
             "--data-cache /proc/fxpipe-cache: the token cache cannot be written there (")


def test_a_dataset_dict_with_an_empty_train_split_is_refused_in_words(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": []}),
                          "test": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"holds no rows in its 'train' split"):
        tokenized(open_corpus(tmp_path / "dd"), ByteTokenizer())


@pytest.mark.parametrize("rows, kind", [([[1.0, 2.0]], "list<element: double>"), ([[[1, 2]]], "list<element: list<element: int64>>"),
                                        ([[], []], "list<element: null>")])
def test_input_ids_that_are_not_flat_integers_are_named(tmp_path, rows, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "ids.parquet")
    with pytest.raises(ValueError, match=rf"has no column 'text', and its 'input_ids' holds {re.escape(kind)}.*not "
                                         rf"token ids \(one flat list of integers per row\)"):
        tokenized(open_corpus(tmp_path / "ids.parquet"), None)
