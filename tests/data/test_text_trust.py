"""Text data: UTF-8 or a refusal naming the file and byte, long lines tokenized in bounded pieces
cut at whitespace, linked files in a data directory reported."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.job._cli import RUN


def _corpus(tmp_path: Path) -> Path:
    from tests.data._corpus import write_corpus

    write_corpus(tmp_path / "texts", docs=20, words=200)
    return tmp_path / "texts"


def test_text_that_is_not_utf8_is_refused_naming_the_file_and_byte(tmp_path):
    from fxpipe.data.corpus import cached_tokens
    from fxpipe.data.tokenizer import ByteTokenizer, load_tokenizer
    from tests.data._corpus import train_bpe, write_corpus

    tok = load_tokenizer(train_bpe(tmp_path / "tok", write_corpus(tmp_path / "texts"), vocab_size=300))
    (tmp_path / "latin1.txt").write_bytes("un café crème".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: byte 6 \(b'\\xe9 cr'...\) is not UTF-8"):
        cached_tokens(tmp_path / "latin1.txt", tok)
    ids, _ = cached_tokens(tmp_path / "latin1.txt", ByteTokenizer())  # bytes as they are
    assert bytes(ids[:-1].astype("uint8")) == "un café crème".encode("latin-1")


def test_a_long_line_is_tokenized_in_bounded_pieces_cut_at_whitespace():
    import numpy as np

    from fxpipe.data.encode_pool import tokenize
    from fxpipe.data.text import pieces
    from fxpipe.data.tokenizer import ByteTokenizer
    from fxpipe.data.tokens import TokenDtype

    line = " ".join(f"w{i}" for i in range(400_000))  # one 2.6 MB line
    cut = pieces(line, limit=1 << 20)
    assert "".join(cut) == line and len(cut) == 3 and all(len(p) <= 1 << 20 for p in cut)
    assert all(p.endswith(" ") for p in cut[:-1])
    assert pieces("x" * 10, limit=4) == ["xxxx", "xxxx", "xx"]  # no whitespace: a hard cut
    ids = tokenize(iter([line.encode(), b"end"]), ByteTokenizer(), TokenDtype.fitting(256))
    assert np.array_equal(ids, np.frombuffer(line.encode() + b"\0end\0", dtype=np.uint8))  # one EOS per document


def test_linked_files_in_a_data_directory_are_reported(tmp_path, monkeypatch, capsys):
    from tests.job._cli import launched

    texts = _corpus(tmp_path)
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not part of the data " * 50)
    (texts / "linked.txt").symlink_to(outside)
    launched(RUN + ["--data", texts], monkeypatch, capsys)
    err = capsys.readouterr().err
    assert f"--data {texts}: 1 linked file(s) not read" in err and "linked.txt" in err, err
