"""``fxpipe prepare-data``: tokenize a corpus (text or a Hugging Face dataset) once, with
every core, into the token cache ``fxpipe run`` then memory-maps
(``fxpipe/data/corpus.py``). Run with the same ``--tokenizer``, ``--text-column`` and
``--data-cache`` as the run; a corpus already prepared is found, not redone."""
from __future__ import annotations

import argparse
import os
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", nargs="+", metavar="PATH",
                   help="text (.txt, .jsonl, a directory of them) or a dataset (a save_to_disk directory, "
                        ".parquet or .arrow files); several paths: each prepared (e.g. --data and --val-data)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="a tokenizer.json or a Hugging Face tokenizer directory (default: bytes; a dataset's "
                        "input_ids are taken as they are)")
    p.add_argument("--text-column", default="text", metavar="NAME",
                   help="a dataset's column of text (default: %(default)s; input_ids where it has none)")
    p.add_argument("--data-cache", metavar="DIR", help="where the token cache goes (default: beside the data)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="tokenizing processes (default: the cores, %(default)s)")
    p.add_argument("--verify", action="store_true",
                   help="tokenize every byte again even when a cache is found (a cache is found by the files' "
                        "sizes, mtimes and sampled bytes), and replace it if it differs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=run_prepare)


class _Stopped(BaseException):
    """SIGTERM or SIGINT while tokenizing: unwinds like Ctrl-C, so the cache writer's
    ``abort`` removes its temporary file (``data/corpus.py``), and is reported."""


def run_prepare(args: argparse.Namespace) -> int:
    import signal

    def stop(signum, frame):
        raise _Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _prepare(args)
    except _Stopped as exc:
        name = signal.Signals(exc.args[0]).name
        print(f"fxpipe prepare-data: stopped by {name}; the partial token cache was removed (no temporary file is "
              f"left); run it again to prepare the data", file=sys.stderr, flush=True)
        return 128 + exc.args[0]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _prepare(args: argparse.Namespace) -> int:
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.base.local_workers import GIB_PER_WORKER, WORKERS_PER_CORE, local_worker_limit
    from fxpipe.data import load_tokenizer, open_corpus, tokenized
    from fxpipe.data.corpus import cache_path
    from tqdm import tqdm

    limit, cores, free_gib = local_worker_limit()
    if not 1 <= args.workers <= limit:  # the cap `fxpipe run` puts on its workers: 1,000 forks only thrash
        raise ValueError(f"--workers must be in [1, {limit}] on this machine ({cores} CPU cores × "
                         f"{WORKERS_PER_CORE}, {free_gib:.1f} GiB free at {GIB_PER_WORKER} GiB each), got "
                         f"{args.workers}; the default is one per core ({os.cpu_count() or 1})")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    for path in args.data:
        corpus = open_corpus(path, args.text_column)
        bar, called = None, False

        def progress(done: int, unit: str, total: int) -> None:
            nonlocal bar, called
            called = True  # batches were encoded: no cache was found
            if args.quiet:
                return
            if bar is None:
                bar = tqdm(total=total, unit=unit, unit_scale=True, desc=os.path.basename(path.rstrip("/")),
                           file=sys.stderr, dynamic_ncols=True)
            bar.update(done - bar.n)

        start = time.perf_counter()
        before = _read_blocks(cache_path(corpus, tokenizer, args.data_cache)) if args.verify else None
        stream, cache = tokenized(corpus, tokenizer, cache_dir=args.data_cache, workers=args.workers,
                                  progress=progress, verify=args.verify)
        seconds = time.perf_counter() - start
        if bar is not None:
            bar.close()
        tokens = len(stream.tokens)
        made = "tokenized" if called else "found"
        rate = f", {tokens / seconds:,.0f} tokens/s with {args.workers} workers" if made == "tokenized" else ""
        print(f"{path}: {made} {tokens:,} tokens ({stream.tokens.dtype.name}, largest id {stream.largest}) "
              f"in {seconds:.1f} s{rate} -> {cache}", flush=True)
        if made == "found":  # where it matters: say what "found" rests on
            print(f"{path}: the cache was found by the files' sizes, mtimes and sampled bytes, not every byte; "
                  f"--verify tokenizes every byte again", flush=True)
        elif before is not None:
            same = before == _read_blocks(cache)
            print(f"{path}: verified every byte: " + ("the cache matched" if same else
                  "the cache found was stale (its blocks differ) and was replaced"), flush=True)
        elif args.verify:
            print(f"{path}: verified every byte: there was no cache to compare with", flush=True)
    return 0


def _read_blocks(base) -> list | None:
    """The block digests a token cache's manifest lists (None: no readable manifest)."""
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    import json
    from pathlib import Path

    try:
        return json.loads(Path(str(base).removesuffix(".bin") + ".json").read_text()).get("blocks")
    except (OSError, ValueError):
        return None
