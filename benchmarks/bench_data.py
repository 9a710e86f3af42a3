"""Tokenizing a large corpus once, with every core, and starting a run on it.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_data.py [--gb 1.0] [--rounds 3] [--workdir DIR]

1. Writes a synthetic corpus of ``--gb`` GB (``.jsonl`` files of ~4 KB documents drawn
   from a Zipf vocabulary) and a 1 MB one, and trains a byte-level BPE (vocabulary 8192)
   on a sample.
2. ``fxpipe prepare-data`` on a 128 MB part: one process on one core (the tokenizers
   library's threads off), one process with the library's own threads, and one worker
   process per core; then on the whole corpus with every core: tokens/s.
3. Start-up of ``fxpipe run`` (a 2-layer Llama directory, dp 2, one step) on the
   prepared large corpus and on the 1 MB one, in interleaved rounds: seconds from launch
   to the first step's log line, medians, and their ratio (the issue's bar: within 10%).

Writes ``benchmarks/results/bench_data.txt``. Takes ~8 min for 1 GB on 2 cores and
~3 GB of disk under ``--workdir`` (default: a temporary directory, removed after).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_log import recorded  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FILE_BYTES = 16 << 20
VOCAB = 8192


def _words(rng: np.random.Generator, n: int = 20000) -> np.ndarray:
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    lengths = rng.integers(2, 10, n)
    return np.array(["".join(rng.choice(letters, k)) for k in lengths], dtype=object)


def write_corpus(directory: Path, total: int, seed: int = 0) -> int:
    """``.jsonl`` files of ``FILE_BYTES`` (the last smaller) adding up to ``total`` bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = _words(rng)
    written, index = 0, 0
    while written < total:
        want = min(FILE_BYTES, total - written)
        lines, size = [], 0
        while size < want:
            ids = rng.zipf(1.2, 700) % len(words)
            line = json.dumps({"text": " ".join(words[ids])}) + "\n"
            lines.append(line)
            size += len(line)
        data = "".join(lines).encode()
        (directory / f"part-{index:05d}.jsonl").write_bytes(data)
        written += len(data)
        index += 1
    return written


def train_tokenizer(sample: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [json.loads(line)["text"] for line in sample.read_text().splitlines()[:2000]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def llama_dir(out: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=160, vocab_size=VOCAB, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)


def fxpipe(*args: str) -> list[str]:
    return [sys.executable, "-m", "fxpipe", *args]


def prepare(corpus: Path, tok: Path, cache: Path, workers: int, library_threads: bool = True) -> tuple[float, int]:
    """(seconds, tokens) of one ``fxpipe prepare-data`` of ``corpus`` into ``cache``, its
    earlier cache of the corpus removed first. ``library_threads`` False: the tokenizers
    library's own threads off (one core per process)."""
    for old in cache.glob(f".{corpus.name}.fxpipe-*"):
        old.unlink()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not library_threads:
        env["TOKENIZERS_PARALLELISM"] = "false"
    start = time.perf_counter()
    out = subprocess.run(fxpipe("prepare-data", str(corpus), "--tokenizer", str(tok), "--data-cache", str(cache),
                                "--workers", str(workers), "--quiet"), check=True, capture_output=True, text=True,
                         cwd=ROOT, env=env).stdout
    seconds = time.perf_counter() - start
    tokens = int(out.split(" tokenized ")[1].split(" tokens")[0].replace(",", ""))
    return seconds, tokens


def startup(corpus: Path, tok: Path, model: Path, cache: Path) -> float:
    """Seconds from launching ``fxpipe run`` to its first step's log line."""
    start = time.perf_counter()
    proc = subprocess.Popen(fxpipe("run", "--model", str(model), "--data", str(corpus), "--tokenizer", str(tok),
                                   "--data-cache", str(cache), "--tp", "1", "--pp", "1", "--dp", "2",
                                   "--micro-batch-size", "2", "--microbatches", "1", "--seq", "64", "--steps", "1",
                                   "--timeline", "none", "--log-interval", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    seen = None
    for line in proc.stdout:
        if line.startswith("iter ") and seen is None:
            seen = time.perf_counter() - start
    err = proc.stderr.read()
    if proc.wait() != 0 or seen is None:
        raise RuntimeError(f"fxpipe run failed: {err[-2000:]}")
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fxpipe-bench-data-"))
    cores = os.cpu_count() or 1
    try:
        with recorded("bench_data"):
            t0 = time.perf_counter()
            big = write_corpus(work / "big", int(args.gb * 1e9))
            small = write_corpus(work / "small", 1 << 20, seed=1)
            part = work / "part"  # the first 8 files: 128 MB
            part.mkdir(exist_ok=True)
            for f in sorted((work / "big").iterdir())[:8]:
                os.link(f, part / f.name)
            print(f"corpus: {big / 1e9:.2f} GB in {len(list((work / 'big').iterdir()))} .jsonl files, "
                  f"written in {time.perf_counter() - t0:.0f} s; small: {small / 1e6:.2f} MB")
            train_tokenizer(work / "small" / "part-00000.jsonl", work / "tok")
            llama_dir(work / "llama")
            core = prepare(part, work / "tok", work / "cache-part", 1, library_threads=False)
            one = prepare(part, work / "tok", work / "cache-part", 1)
            every = prepare(part, work / "tok", work / "cache-part", cores)
            print(f"prepare-data, 128 MB part ({one[1]:,} tokens; seconds include the command's start): "
                  f"1 process on 1 core {core[1] / core[0]:,.0f} tokens/s; 1 process with the tokenizers "
                  f"library's threads {one[1] / one[0]:,.0f} tokens/s; {cores} worker processes "
                  f"{every[1] / every[0]:,.0f} tokens/s ({core[0] / every[0]:.2f}x one core, "
                  f"{one[0] / every[0]:.2f}x the library's threads)")
            whole = prepare(work / "big", work / "tok", work / "cache", cores)
            print(f"prepare-data, whole corpus, {cores} workers: {whole[1]:,} tokens in {whole[0]:.1f} s, "
                  f"{whole[1] / whole[0]:,.0f} tokens/s, {big / whole[0] / 1e6:.1f} MB/s")
            prepare(work / "small", work / "tok", work / "cache", cores)
            startup(work / "small", work / "tok", work / "llama", work / "cache")  # warm: costs cache, page cache
            times: dict[str, list[float]] = {"1 MB": [], f"{big / 1e9:.1f} GB": []}
            for _ in range(args.rounds):
                for name, corpus in zip(times, (work / "small", work / "big")):
                    times[name].append(startup(corpus, work / "tok", work / "llama", work / "cache"))
            medians = {k: statistics.median(v) for k, v in times.items()}
            for name, values in times.items():
                print(f"start-up to the first step, {name} prepared corpus: median {medians[name]:.2f} s "
                      f"({', '.join(f'{v:.2f}' for v in values)})")
            small_s, big_s = medians.values()
            print(f"start-up ratio large / small: {big_s / small_s:.3f}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
