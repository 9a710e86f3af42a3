"""Untrusted inputs ``fxpipe run`` refuses in the launcher, before any worker starts (issue:
trust, round four): a token cache whose ids exceed the model's vocabulary — its manifest's
record and block digests rewritten with the ids, as a forger would — and a checkpoint
whose data position is damaged. Each runs ``fxpipe.cli.main`` in this process with the
launcher replaced by a function that fails the test (``tests/job/test_preflight_trust.py``)."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from fxpipe.data import ByteTokenizer, open_corpus, open_data, tokenized
from fxpipe.job.config import TrainConfig
from tests.checkpoint._ckpt_files import make_checkpoint, schedule
from tests.data._corpus import write_corpus
from tests.job._cli import RUN, TINY_NAMES, launched, refused

VOCAB = 256
"""gpt-tiny's vocabulary rows, and the byte tokenizer's ids (0..255)."""


def _forge(cache, ids: np.ndarray, **record) -> None:
    """Write ``ids`` into the cache with every block digest recomputed and ``record``'s
    manifest fields: a cache edited by someone who knows its format."""
    ids.astype("<u2").tofile(cache)
    manifest = cache.with_suffix(".json")
    doc = json.loads(manifest.read_text())
    n = doc["block_tokens"]
    doc["blocks"] = [hashlib.sha256(ids[i:i + n].astype("<u2").tobytes()).hexdigest() for i in range(0, len(ids), n)]
    doc.update(record)
    manifest.write_text(json.dumps(doc))


@pytest.fixture
def cached(tmp_path):
    """A text corpus and the token cache ``fxpipe run --data`` finds beside it."""
    write_corpus(tmp_path / "texts")
    _, cache = tokenized(open_corpus(tmp_path / "texts"), ByteTokenizer())
    return tmp_path / "texts", cache


def test_an_honest_cache_is_launched(cached, monkeypatch, capsys):
    texts, _ = cached
    assert launched(RUN + ["--data", texts], monkeypatch, capsys).data == str(texts)


def test_a_cache_whose_ids_exceed_its_record_is_refused_before_workers(cached, monkeypatch, capsys):
    """Ids past the vocabulary, the manifest's largest id left as it was: the preflight
    reads the ids (before, it took the record and rank 0 refused after spawning)."""
    texts, cache = cached
    ids = np.fromfile(cache, dtype="<u2")
    recorded = int(ids.max())
    ids[len(ids) // 2] = VOCAB + 44
    _forge(cache, ids)
    refused(RUN + ["--data", texts], monkeypatch, capsys,
             f"--data: the token cache {cache} (of {texts}) holds id {VOCAB + 44}, but its manifest records "
             f"{recorded} as the largest", "delete it and its .json")


def test_a_cache_forged_with_its_record_is_refused_before_workers(cached, monkeypatch, capsys):
    """The record rewritten to match the ids (and no tokenizer vocabulary to hold it
    under): the ids read are past gpt-tiny's vocabulary, refused with both numbers."""
    texts, cache = cached
    ids = np.fromfile(cache, dtype="<u2")
    ids[-1] = VOCAB + 1000
    _forge(cache, ids, largest=VOCAB + 1000, vocab_size=None)
    refused(RUN + ["--data", texts], monkeypatch, capsys,
             f"gpt-tiny has a vocabulary of {VOCAB} tokens", f"the largest token id in {texts} is {VOCAB + 1000}",
             f"at least {VOCAB + 1001}")


# ---- a damaged data position in the checkpoint a resume takes ----------------------------------------
STEP = 2
BATCH = 2 * 2
"""RUN's global batch: --micro-batch-size 2 × --microbatches 2 (dp 1)."""


def _windows() -> int:
    """The training windows of RUN's data: the built-in corpus, less the default validation share."""
    return open_data(None, seq=16, val_fraction=TrainConfig().val_fraction).train.count


def _resume(root, data: dict):
    make_checkpoint(root, STEP, names=TINY_NAMES, source="GPT",
                    extra={"lr_scheduler": schedule(STEP), "data": data})
    return RUN + ["--checkpoint-dir", root, "--resume"]


def _data(**changes) -> dict:
    honest = dict(position=STEP * BATCH, windows=_windows(), seq=16, seed=TrainConfig().parallel.seed,
                  source="python standard library")
    return {**honest, **changes}


def test_an_intact_data_position_is_launched(tmp_path, monkeypatch, capsys):
    assert launched(_resume(tmp_path / "ck", _data()), monkeypatch, capsys).resume


@pytest.mark.parametrize("changes, expected", [
    (dict(position=10**12), "the checkpoint's data position 1000000000000 is past what its 2 steps can have read "
                            "(at most {bound}: 2 × {per_step} windows)"),
    (dict(position=-3), "the checkpoint's data position must be an integer >= 0, got -3"),
    (dict(position="12"), "the checkpoint's data position must be an integer >= 0, got 12"),
    (dict(windows=5), "the checkpoint was trained on 5 windows of 16 tokens"),
    (dict(seed=7), "the checkpoint's data order was drawn with --seed 7"),
], ids=["past-its-steps", "negative", "a-string", "other-windows", "other-seed"])
def test_a_damaged_data_position_is_refused_before_workers(tmp_path, monkeypatch, capsys, changes, expected):
    """Refused on rank 0 after spawning before; now by the launcher, naming the checkpoint
    and the numbers (the manifest's digest is recomputed: the damage is in the values)."""
    root = tmp_path / "ck"
    per_step = max(_windows(), BATCH)
    refused(_resume(root, _data(**changes)), monkeypatch, capsys,
             f"--resume: {root / 'step_0000002'}: " + expected.format(bound=STEP * per_step, per_step=per_step))
