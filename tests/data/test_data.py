"""The data path (fxpipe/data): token files, text through a tokenizer and its cache,
packed windows, disjoint per-replica shares and a position that resumes exactly."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from fxpipe.data import (ByteTokenizer, DataStream, PackedWindows, TokenStream, load_tokenizer, max_token,
                         open_data, open_token_file, stdlib_stream)
from fxpipe.data.corpus import cached_tokens, open_corpus, tokenized
from tests.data._corpus import train_bpe, write_corpus


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_token_file_is_memory_mapped(tmp_path, dtype):
    ids = np.arange(70000 if dtype == "uint32" else 1000, dtype=dtype)
    ids.tofile(tmp_path / "t.bin")
    got = open_token_file(tmp_path / "t.bin", dtype)
    assert isinstance(got, np.memmap) and (got == ids).all() and max_token(got) == ids.max()


def test_npy_token_file(tmp_path):
    np.save(tmp_path / "t.npy", np.array([5, 1, 9], dtype=np.int32))
    assert open_token_file(tmp_path / "t.npy").tolist() == [5, 1, 9]
    np.save(tmp_path / "bad.npy", np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="2-D int32 array"):
        open_token_file(tmp_path / "bad.npy")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="not a plain numpy array file"):
        open_token_file(tmp_path / "obj.npy")  # never unpickled


def test_bad_token_files_name_the_numbers_and_the_fix(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
    with pytest.raises(ValueError, match=r"6 bytes, not a multiple of 4 \(uint32\).*--data-dtype uint16"):
        open_token_file(tmp_path / "odd.bin", "uint32")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        open_token_file(tmp_path / "empty.bin")
    os.mkfifo(tmp_path / "fifo.bin")
    with pytest.raises(ValueError, match="a FIFO, not a regular file"):
        open_token_file(tmp_path / "fifo.bin")
    with pytest.raises(ValueError, match="unknown --data-dtype 'int8'"):
        open_token_file(tmp_path / "empty.bin", "int8")


def test_text_is_tokenized_with_eos_between_documents_and_cached(tmp_path):
    texts = write_corpus(tmp_path / "texts")
    tokdir = train_bpe(tmp_path / "tok", texts, vocab_size=300)
    tok = load_tokenizer(tokdir)
    assert tok.eos_id == tok.impl.token_to_id("<|endoftext|>")
    tokens, cache = cached_tokens(tmp_path / "texts", tok)
    # The reference: each document encoded alone by the tokenizers library, EOS appended,
    # in the sorted file order (a.txt, then b.jsonl's lines).
    ref = []
    for doc in texts:
        ref += tok.impl.encode(doc, add_special_tokens=False).ids + [tok.eos_id]
    assert tokens.tolist() == ref
    assert cache.parent == tmp_path and cache.name.startswith(".texts.fxpipe-")
    before = cache.stat().st_mtime_ns
    again, cache2 = tokenized(open_corpus(tmp_path / "texts"), tok)
    assert cache2 == cache and cache.stat().st_mtime_ns == before and isinstance(again.tokens, np.memmap)
    assert again.largest == max(ref) and again.vocab_size == 300
    (tmp_path / "texts" / "a.txt").write_text(texts[0] + " changed")
    assert cached_tokens(tmp_path / "texts", tok)[1] != cache, "the cache is keyed by content"
    assert cached_tokens(tmp_path / "texts", ByteTokenizer())[1] != cache, "and by tokenizer"


def test_a_cut_token_cache_is_tokenized_again_and_an_edited_one_refused(tmp_path, monkeypatch):
    """The cache's name says what it was made from; its manifest says what it holds: a
    cache cut short (a crash before the disk had it) is tokenized again; a block edited on
    disk is refused when first read, naming the block: never trained on."""
    write_corpus(tmp_path / "texts")
    monkeypatch.setattr("fxpipe.data.token_cache.BLOCK_TOKENS", 64)  # several blocks of a small corpus
    tok = ByteTokenizer()
    tokens, cache = cached_tokens(tmp_path / "texts", tok)
    ref = np.array(tokens).tolist()
    assert len(ref) > 4 * 64
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    again, cache2 = cached_tokens(tmp_path / "texts", tok)
    assert cache2 == cache and np.array(again).tolist() == ref
    data = bytearray(cache.read_bytes())
    data[-2] ^= 1
    cache.write_bytes(bytes(data))
    stream, _ = tokenized(open_corpus(tmp_path / "texts"), tok)
    assert stream.read(0, 4).tolist() == ref[:4], "a read of good blocks"
    last = (len(ref) - 1) // 64
    with pytest.raises(ValueError, match=rf"block {last} \(ids {last * 64}\.\.{last * 64 + 63}\) does not match its manifest"):
        stream.read(len(ref) - 3, len(ref))


def test_jsonl_line_without_text_is_refused(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2 has no string field 'text'"):
        cached_tokens(tmp_path / "d.jsonl", ByteTokenizer())


def _stream(n: int) -> TokenStream:
    return TokenStream(np.arange(n, dtype=np.uint32), "arange")


def test_windows_pack_seq_plus_one_tokens():
    w = PackedWindows(_stream(103), seq=10)
    assert w.count == 10 and w.window(3).tolist() == list(range(30, 41))
    train, val = w.split(0.2)
    assert (train.count, val.count) == (8, 2) and val.window(0).tolist() == list(range(80, 91))


def test_replica_shares_are_disjoint_and_make_the_global_batch():
    w = PackedWindows(_stream(10 * 16 + 1), seq=16)  # 10 windows: batches straddle epochs
    one = DataStream(w, global_batch=4, seed=3)
    halves = [DataStream(w, global_batch=4, dp=2, dp_rank=r, seed=3) for r in range(2)]
    seen = []
    for _ in range(5):  # two epochs
        full = one.next_batch()
        parts = [h.next_batch() for h in halves]
        assert torch.equal(torch.cat(parts), full)
        assert torch.equal(halves[1].global_rows(parts[1])[2:], parts[1])
        seen += full[:, 0].tolist()
    assert sorted(seen[:10]) == sorted(seen[10:20]) == list(range(0, 160, 16)), "each window once per epoch"
    assert seen[:10] != seen[10:20], "a new order each epoch"


def test_position_resumes_exactly_in_another_layout():
    w = PackedWindows(_stream(50 * 8 + 1), seq=8)
    ref = DataStream(w, global_batch=6, seed=1)
    batches = [ref.next_batch() for _ in range(12)]
    first = DataStream(w, global_batch=6, dp=3, dp_rank=0, seed=1)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state()))  # as a checkpoint's extra keeps it
    resumed = [DataStream(w, global_batch=6, dp=2, dp_rank=r, seed=1) for r in range(2)]
    for r in resumed:
        r.load_state(state, steps=5)
    for step in range(5, 12):
        assert torch.equal(torch.cat([r.next_batch() for r in resumed]), batches[step])
    with pytest.raises(ValueError, match="trained on 50 windows of 8 tokens.*this run has 25 of 16"):
        DataStream(PackedWindows(_stream(50 * 8 + 1), seq=16), global_batch=6, seed=1).load_state(state)
    # A position no 5 steps can reach (a manifest's 10^18): refused with the numbers, not read.
    with pytest.raises(ValueError, match=r"data position 1000000000000000000 is past what its 5 steps can have read "
                                         r"\(at most 250: 5 × 50 windows\)"):
        DataStream(w, global_batch=6, seed=1).load_state({**state, "position": 10**18}, steps=5)


def test_builtin_default_goes_through_the_same_path():
    s = stdlib_stream(1 << 16)
    assert s.vocab_size == 256 and max_token(s.tokens) < 256
    assert (s.tokens == 0).sum() >= 1, "files separated by the byte tokenizer's EOS (NUL)"
    src = open_data(None, seq=32, val_fraction=0.05)
    assert src.val is not None and src.train.count + src.val.count == src.train.total_windows


def test_files_that_are_neither_text_nor_tokens_are_refused(tmp_path):
    """A single --data file must be text (.txt, .jsonl), tokens (.bin, .npy) or a dataset
    (.parquet, .arrow): a .pt read as text would train on its bytes, a damaged .parquet is
    named; an empty or archived .npy is one line."""
    (tmp_path / "train.pt").write_bytes(os.urandom(2048))
    with pytest.raises(ValueError, match=r"train.pt: fxpipe reads text from .txt or .jsonl.*not \.pt"):
        open_data(str(tmp_path / "train.pt"), seq=8)
    (tmp_path / "train.parquet").write_bytes(os.urandom(2048))
    with pytest.raises(ValueError, match=r"train.parquet is not a readable parquet file"):
        open_data(str(tmp_path / "train.parquet"), seq=8)
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.npy is not a plain numpy array file"):
        open_token_file(tmp_path / "empty.npy")
    np.savez(tmp_path / "ids.npz", ids=np.arange(10))
    os.replace(tmp_path / "ids.npz", tmp_path / "ids.npy")
    with pytest.raises(ValueError, match=r"ids.npy is a numpy archive \(.npz\), not one array"):
        open_token_file(tmp_path / "ids.npy")


def test_model_directory_tokenizer_and_pickled_weights(tmp_path):
    """A model directory's own tokenizer is used whatever form it takes (never bytes for a
    model that brought one); weights only as pickles are refused, not trained from scratch."""
    from fxpipe.job.config import TrainConfig
    from fxpipe.job.prepare import tokenizer_path, weights_dir

    (tmp_path / "config.json").write_text("{}")
    config = TrainConfig(model=str(tmp_path))
    assert tokenizer_path(config) is None and weights_dir(config) is None  # nothing there: bytes, init
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert tokenizer_path(config) == str(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(ValueError, match=r"holds its weights as pytorch_model.bin \(pickle\).*safetensors"):
        weights_dir(config)
    (tmp_path / "elsewhere").mkdir()
    assert weights_dir(TrainConfig(model=str(tmp_path), init_from=str(tmp_path / "elsewhere"))) == \
        str(tmp_path / "elsewhere")
