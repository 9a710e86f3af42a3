"""Tokenizers for text data: bytes (the built-in default), a ``tokenizer.json``
through the ``tokenizers`` library, or a Hugging Face tokenizer directory.

Each has a vocabulary size (checked against the model's before a worker starts), an
EOS id (the separator packed between documents, ``fxpipe/data/windows.py``) and a
digest of its files (part of the token cache's key: the same text under another
tokenizer is other ids).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fxpipe.base.safe_io import read_bounded, read_json_object, refuse_remote_code

MAX_TOKENIZER_BYTES = 256 << 20
"""A tokenizer file larger than this is refused unread (Llama 3's tokenizer.json is 9 MB)."""
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
"""Special tokens taken as EOS when no ``tokenizer_config.json`` names one (GPT-2, Llama 2,
Llama 3, Gemma, ... and BERT-style tokenizers)."""


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 (no download, no vocabulary file). NUL (0) never occurs
    in text, so it separates documents."""
    vocab_size: int = 256
    eos_id: int = 0
    digest: str = "bytes-v1"
    name: str = "bytes"

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[bytes]:
        return [t if isinstance(t, bytes) else t.encode("utf-8") for t in texts]


@dataclass(frozen=True)
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from ``tokenizer.json``) or a transformers tokenizer."""
    impl: Any = field(repr=False)
    vocab_size: int
    eos_id: int
    digest: str
    name: str

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[list[int]]:
        texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        if hasattr(self.impl, "encode_batch"):  # the tokenizers library: parallel, in Rust
            return [e.ids for e in self.impl.encode_batch(texts, add_special_tokens=False)]
        return self.impl(texts, add_special_tokens=False)["input_ids"]


def _json_file(path: Path) -> dict:
    return read_json_object(path, MAX_TOKENIZER_BYTES)


def _eos_name(directory: Path) -> str | None:
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    eos = _json_file(config).get("eos_token")
    if isinstance(eos, dict):  # transformers' AddedToken form
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
"""Files of a Hugging Face tokenizer directory besides its vocabulary files."""


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """``path``: a ``tokenizer.json`` file, or a directory holding one (its
    ``tokenizer_config.json`` names the EOS), or a Hugging Face tokenizer directory
    without it (loaded by ``transformers.AutoTokenizer``, local files only)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    file = path if path.is_file() else path / "tokenizer.json"
    directory = file.parent
    if file.is_file():
        from tokenizers import Tokenizer

        data = read_bounded(file, MAX_TOKENIZER_BYTES)
        try:
            impl = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 (the Rust library raises its own Exception)
            raise ValueError(f"{file} is not a tokenizers JSON file: {' '.join(str(exc).split())[:200]}") from None
        digest = hashlib.sha256(data).hexdigest()
        named = _eos_name(directory)
        candidates = [named] if named else list(_EOS_NAMES)
        eos = next((impl.token_to_id(n) for n in candidates if impl.token_to_id(n) is not None), None)
        if eos is None:
            raise ValueError(f"{file}: no EOS token to separate documents ("
                             f"{'tokenizer_config.json names ' + repr(named) + ', not in the vocabulary' if named else 'none of ' + ', '.join(_EOS_NAMES)}); "
                             f"add one as a special token when training the tokenizer")
        return HFTokenizer(impl, impl.get_vocab_size(with_added_tokens=True), eos, digest, str(file))
    from transformers import AutoTokenizer

    for name in ("tokenizer_config.json", "config.json"):  # AutoTokenizer reads both for an auto_map
        if (path / name).is_file():
            refuse_remote_code(_json_file(path / name), path / name)
    try:
        impl = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {path}: neither a tokenizer.json nor a Hugging Face tokenizer "
                         f"directory ({' '.join(str(exc).split())[:200]})") from None
    if impl.eos_token_id is None:
        raise ValueError(f"--tokenizer {path} has no EOS token to separate documents")
    # The tokenizer's own files only: a model directory beside them holds weights far larger
    # than any tokenizer, which say nothing about the ids.
    names = {*getattr(impl, "vocab_files_names", {}).values(), *TOKENIZER_SIDE_FILES}
    digest = hashlib.sha256()
    for f in sorted(path / n for n in names):
        if f.is_file() and not f.is_symlink():
            digest.update(f.name.encode() + b"\0" + read_bounded(f, MAX_TOKENIZER_BYTES))
    return HFTokenizer(impl, len(impl), impl.eos_token_id, digest.hexdigest(), str(path))
