"""The token cache: a corpus tokenized once into a flat token file, with a manifest.

Keyed without reading the corpus: the cache's name carries a digest of each source
file's relative path, size, modification time and sampled bytes (``fingerprint``: its
first, last and a few spread blocks), the tokenizer's digest, the column read and this
format's version. Computing it costs a ``stat`` and a few small reads per file, so a
run's start-up on a prepared corpus does not grow with the corpus, on any rank. Editing
a file changes its time (and usually its size); another tokenizer or column is another
cache. A copy of the corpus with new times is tokenized again.

The manifest (JSON, written last, atomically: it is the cache's commit mark) records
the number of ids, their dtype, the largest id and a sha256 per block of
``BLOCK_TOKENS`` ids. A cache whose size disagrees with its manifest (cut short by a
crash or a full disk) is tokenized again; a block whose bytes disagree (edited or
damaged on disk) is refused when a run first reads it (``ManifestBlocks``), so no id
is trained on unverified and none is hashed twice. The manifest's largest id is a
record, not evidence: whoever can edit the ids can rewrite it and the digests with
them, so ``fxpipe run``'s preflight reads the ids themselves for the vocabulary check
(``TokenStream.scanned_largest_id``) and refuses a cache whose ids disagree with it.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fxpipe.base.safe_io import check_regular, open_regular, read_json_object
from fxpipe.data.tokens import TokenDtype, TokenStream

FORMAT = "fxpipe-tokens-v3"
BLOCK_TOKENS = 1 << 20
"""Ids per verified block (2 MiB of uint16: about a millisecond of sha256)."""
MAX_MANIFEST = 256 << 20
"""A manifest larger than this is refused unread (a 1 TB corpus's is about 70 MB)."""
SAMPLE = 1 << 16
SAMPLES = 8
"""Bytes per sampled block, and blocks sampled per file besides its first and last."""


def fingerprint(files: list[Path], root: Path, extra: str) -> str:
    """sha256 of ``extra`` (tokenizer, column, format) and each file's relative path,
    size, mtime and sampled bytes: a stat and at most ``SAMPLES + 2`` reads per file."""
    h = hashlib.sha256(f"{FORMAT}\0{extra}".encode())
    for f in files:
        st = check_regular(f)
        rel = str(f.relative_to(root)) if f != root else f.name
        h.update(f"\0{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        fd = open_regular(f)
        try:
            last = max(st.st_size - SAMPLE, 0)
            for offset in sorted({0, last, *(last * k // (SAMPLES + 1) for k in range(1, SAMPLES + 1))}):
                h.update(os.pread(fd, SAMPLE, offset))
        finally:
            os.close(fd)
    return h.hexdigest()


def cache_base(path: Path, key: str, cache_dir: str | os.PathLike | None) -> Path:
    """``.NAME.fxpipe-KEY`` beside the data (for a directory, in its parent) or in
    ``cache_dir``; the token file adds ``.bin``, the manifest ``.json`` (which names the dtype)."""
    where = Path(cache_dir) if cache_dir is not None else path.parent
    return where / f".{path.name}.fxpipe-{key[:24]}"


@dataclass
class CacheWriter:
    """Appends ids to a new token file under a temporary name, hashing each block and
    keeping the largest id as they pass; ``commit`` renames it and writes the manifest."""
    base: Path
    dtype: TokenDtype
    vocab_size: int | None
    """The tokenizer's vocabulary (None: ids rows read without one), recorded for the run."""
    documents: int = 0
    count: int = 0
    largest: int = -1
    blocks: list[str] = field(default_factory=list)
    _block: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    _in_block: int = 0

    def __post_init__(self) -> None:
        self.tmp = self.base.with_name(f"{self.base.name}.{os.getpid()}.tmp")
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self.file = open(fd, "wb")
        self.np_dtype = np.dtype(self.dtype.value).newbyteorder("<")

    def append(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        ids = ids.astype(self.np_dtype, copy=False)
        self.largest = max(self.largest, int(ids.max()))
        if self.vocab_size is not None and self.largest >= self.vocab_size:
            raise ValueError(f"token id {self.largest} is beyond the tokenizer's vocabulary of {self.vocab_size}: the "
                             f"ids were made with another tokenizer; give that one with --tokenizer")
        self.file.write(ids.tobytes())
        self.count += ids.size
        data, at = memoryview(ids.view(np.uint8)), 0
        while at < len(data):  # the block digests, cut at BLOCK_TOKENS ids whatever the appends
            take = min(len(data) - at, (BLOCK_TOKENS - self._in_block) * self.np_dtype.itemsize)
            self._block.update(data[at:at + take])
            at += take
            self._in_block += take // self.np_dtype.itemsize
            if self._in_block == BLOCK_TOKENS:
                self.blocks.append(self._block.hexdigest())
                self._block, self._in_block = hashlib.sha256(), 0

    def commit(self, source: dict) -> Path:
        """The token file under its name, then its manifest (``source``: what it was made
        from, for people reading it). Returns the token file's path."""
        if self._in_block:
            self.blocks.append(self._block.hexdigest())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        payload = self.base.with_name(self.base.name + ".bin")
        os.replace(self.tmp, payload)
        manifest = dict(format=FORMAT, dtype=self.dtype.value, vocab_size=self.vocab_size, tokens=self.count,
                        largest=self.largest,
                        documents=self.documents, block_tokens=BLOCK_TOKENS, blocks=self.blocks, source=source)
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with open(fd, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.tmp, self.base.with_name(self.base.name + ".json"))
        return payload

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class ManifestBlocks:
    """Checks each block of a cached token file against its manifest's sha256 the first
    time a read touches it."""

    def __init__(self, path: Path, digests: list[str], block_tokens: int) -> None:
        self.path, self.digests, self.block_tokens = path, digests, block_tokens
        self.verified = np.zeros(len(digests), dtype=bool)

    def check(self, tokens: np.ndarray, start: int, stop: int) -> None:
        for b in range(start // self.block_tokens, (max(stop, start + 1) - 1) // self.block_tokens + 1):
            if b >= len(self.digests) or self.verified[b]:
                continue
            lo = b * self.block_tokens
            got = hashlib.sha256(np.ascontiguousarray(tokens[lo:lo + self.block_tokens]).view(np.uint8)).hexdigest()
            if got != self.digests[b]:
                raise ValueError(f"{self.path}: block {b} (ids {lo}..{lo + self.block_tokens - 1}) does not match its "
                                 f"manifest: the token cache was edited or damaged on disk; delete it and its .json "
                                 f"(fxpipe prepare-data or the next run tokenizes the corpus again)")
            self.verified[b] = True


def open_cache(base: Path, source: str) -> TokenStream | None:
    """The cached stream at ``base`` (ids memory-mapped, blocks verified as read), or None
    when there is no complete cache: no manifest, a manifest that is not this format, or a
    token file whose size is not the manifest's count (cut short: tokenized again)."""
    payload, manifest_path = base.with_name(base.name + ".bin"), base.with_name(base.name + ".json")
    try:
        manifest = read_json_object(manifest_path, MAX_MANIFEST, follow=False)
        size = check_regular(payload, follow=False).st_size
    except (OSError, ValueError):  # missing, a link, not a regular file, not a JSON object
        return None
    dtype, count, largest = manifest.get("dtype"), manifest.get("tokens"), manifest.get("largest")
    blocks, block_tokens = manifest.get("blocks"), manifest.get("block_tokens")
    vocab_size = manifest.get("vocab_size")
    if (manifest.get("format") != FORMAT or dtype not in {d.value for d in TokenDtype}
            or not (vocab_size is None or type(vocab_size) is int and vocab_size > 0)
            or not all(type(v) is int and v > 0 for v in (count, block_tokens)) or type(largest) is not int
            or not isinstance(blocks, list) or len(blocks) != -(-count // block_tokens)
            or not all(isinstance(d, str) for d in blocks) or size != count * np.dtype(dtype).itemsize):
        return None
    # Ranges: the largest id is what the preflight checks the vocabulary against, so a
    # manifest's "largest": -1 or an id past its own vocabulary or dtype is no cache at all;
    # every document adds at least one id.
    documents = manifest.get("documents")
    if (not 0 <= largest <= np.iinfo(np.dtype(dtype)).max or (vocab_size is not None and largest >= vocab_size)
            or type(documents) is not int or not 1 <= documents <= count):
        return None
    tokens = np.memmap(payload, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    return TokenStream(tokens, source, vocab_size, largest=largest,
                       blocks=ManifestBlocks(payload, blocks, block_tokens))
