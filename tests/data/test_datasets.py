"""Hugging Face datasets as --data (fxpipe/data/hf_dataset.py) and the token cache
(fxpipe/data/token_cache.py, corpus.py): every form gives the ids the same text gives as
.txt files, id rows are taken as they are, bad datasets are one line, a prepared corpus
is found without reading it, and parallel tokenizing writes what one process writes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fxpipe.cli import main
from fxpipe.data import load_tokenizer, open_corpus, open_data, tokenized
from tests.data._corpus import train_bpe, write_corpus

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents as a directory of .txt files (one per document, sorted), a
    save_to_disk Dataset and DatasetDict, a Parquet file and an Arrow file, a BPE tokenizer."""
    root = tmp_path_factory.mktemp("datasets")
    texts = write_corpus(root / "texts", docs=12, words=60)
    (root / "txt").mkdir()
    for i, t in enumerate(texts):
        (root / "txt" / f"{i:03d}.txt").write_text(t)
    ds = datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
    ds.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": ds, "validation": ds.select([0])}).save_to_disk(str(root / "dict"))
    ds.to_parquet(str(root / "d.parquet"))
    (root / "arrow").mkdir()
    import pyarrow as pa  # the Arrow IPC file format (save_to_disk writes the stream format)

    with pa.OSFile(str(root / "arrow" / "part-0.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, ds.data.table.schema) as writer:
            writer.write_table(ds.data.table)
    train_bpe(root / "tok", texts, vocab_size=300)
    return root, texts


def _ids(path, tokenizer=None, **kw):
    stream, cache = tokenized(open_corpus(path, **kw), tokenizer)
    return stream.read(0, len(stream.tokens)).tolist(), stream, cache


@pytest.mark.parametrize("form", ["saved", "dict", "d.parquet", "arrow"])
@pytest.mark.parametrize("bpe", [False, True])
def test_every_dataset_form_gives_the_ids_of_the_same_text(corpus, form, bpe):
    root, texts = corpus
    tok = load_tokenizer(root / "tok") if bpe else None
    ref, ref_stream, _ = _ids(root / "txt", tok)
    got, stream, cache = _ids(root / form, tok)
    assert got == ref and stream.vocab_size == ref_stream.vocab_size == (300 if bpe else 256)
    eos = tok.eos_id if bpe else 0
    assert got.count(eos) == len(texts), "one EOS after each row"
    manifest = json.loads(cache.with_suffix(".json").read_text())
    assert manifest["documents"] == len(texts) and manifest["largest"] == max(ref) == stream.largest


def test_input_ids_rows_are_taken_as_they_are(tmp_path, corpus):
    root, _ = corpus
    rows = [[5, 6, 7], [8], [9, 10]]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "ids"))
    got, stream, _ = _ids(tmp_path / "ids")
    assert got == [5, 6, 7, 8, 9, 10] and stream.vocab_size is None, "no tokenizer: no EOS, no vocabulary"
    tok = load_tokenizer(root / "tok")
    got, stream, _ = _ids(tmp_path / "ids", tok)
    assert got == [5, 6, 7, tok.eos_id, 8, tok.eos_id, 9, 10, tok.eos_id] and stream.vocab_size == 300
    datasets.Dataset.from_dict({"input_ids": [[1, 299], [300]]}).save_to_disk(str(tmp_path / "beyond"))
    with pytest.raises(ValueError, match="token id 300 is beyond the tokenizer's vocabulary of 300"):
        _ids(tmp_path / "beyond", tok)
    assert not list(tmp_path.glob(".beyond.fxpipe-*")), "nothing is left under the cache's name"


def test_bad_datasets_are_one_line_naming_the_fix(tmp_path):
    ds = datasets.Dataset.from_dict({"body": ["a", "b"], "n": [1, 2]})
    ds.save_to_disk(str(tmp_path / "nocol"))
    with pytest.raises(ValueError, match=r"has no column 'text' \(its columns: body, n\).*--text-column"):
        open_data(str(tmp_path / "nocol"), seq=4)
    with pytest.raises(ValueError, match=r"column 'n' holds int64, not text"):
        open_data(str(tmp_path / "nocol"), seq=4, options=_column("n"))
    ds.select([]).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="holds no rows"):
        open_data(str(tmp_path / "empty"), seq=4, options=_column("body"))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(ValueError, match=r"holds the splits test, no 'train'"):
        open_data(str(tmp_path / "nosplit"), seq=4)
    datasets.Dataset.from_dict({"text": ["a", None]}).save_to_disk(str(tmp_path / "null"))
    with pytest.raises(ValueError, match=r"row 1 of column 'text' is empty \(null\)"):
        open_data(str(tmp_path / "null"), seq=4)


def _column(name):
    from fxpipe.data import CorpusOptions

    return CorpusOptions(column=name)


def test_a_prepared_corpus_is_found_without_reading_it(corpus, monkeypatch):
    """The key is a stat and sampled bytes per file: a rank never reads the corpus (or
    imports datasets) to find its cache."""
    root, _ = corpus
    ref, _, cache = _ids(root / "saved")

    def no_reading(*args, **kwargs):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr("fxpipe.data.corpus.open_rows", no_reading)
    monkeypatch.setattr("fxpipe.data.corpus.documents", no_reading)
    got, _, again = _ids(root / "saved")
    assert got == ref and again == cache
    monkeypatch.undo()
    (root / "saved" / "state.json").touch()  # a new time: the key moves, tokenized again
    assert _ids(root / "saved")[2] != cache


def test_prepare_data_tokenizes_with_workers_like_one_process(tmp_path, capsys, monkeypatch):
    """Batches encoded by 2 forked workers, written in order, equal one process's ids and
    the tokenizers library's own encoding of each document."""
    monkeypatch.setattr("fxpipe.data.encode_pool.TASK_CHARS", 256)  # many batches of a small corpus
    texts = write_corpus(tmp_path / "texts", docs=30, words=80)
    tok_dir = train_bpe(tmp_path / "tok", texts, vocab_size=300)
    assert main(["prepare-data", str(tmp_path / "texts"), "--tokenizer", str(tok_dir), "--workers", "2",
                 "--data-cache", str(tmp_path / "cache"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "tokenized" in out and "with 2 workers" in out and str(tmp_path / "cache") in out
    tok = load_tokenizer(tok_dir)
    stream, cache = tokenized(open_corpus(tmp_path / "texts"), tok, cache_dir=tmp_path / "cache")
    ref = []
    for t in texts:
        ref += tok.impl.encode(t, add_special_tokens=False).ids + [tok.eos_id]
    assert stream.read(0, len(stream.tokens)).tolist() == ref and cache.parent == tmp_path / "cache"
    assert main(["prepare-data", str(tmp_path / "texts"), "--tokenizer", str(tok_dir),
                 "--data-cache", str(tmp_path / "cache")]) == 0
    assert "found" in capsys.readouterr().out
    assert isinstance(stream.tokens, np.memmap)
