"""Compatibility matrix: every causal-LM family of the installed transformers, and the
zoo of models written outside transformers (``fxpipe/models/zoo``, rows ``zoo:<name>``).

For each family that builds offline as a tiny model (``compat_families.py``):

  capture   fxpipe.capture in this process; the captured loss must equal eager
  tp2       fxpipe.parallelize(tp=2) in a gloo world of 2
  pp2       fxpipe.parallelize(pp=2) in a gloo world of 2
  tp2×pp2   fxpipe.parallelize(tp=2, pp=2) in a gloo world of 4

Each parallel run trains two SGD steps (2 microbatches) and is compared with one
process: both losses and every first-step gradient (``compat_cells.RTOL``). One
world per size runs every family; a family that hangs is cut off after
``--timeout`` seconds and the rest go on in a fresh world.

    .venv/bin/python benchmarks/compat.py                     # everything (long)
    .venv/bin/python benchmarks/compat.py --families llama,gpt2 --merge
    .venv/bin/python benchmarks/compat.py --families zoo --merge   # the zoo only
    .venv/bin/python benchmarks/compat.py --render-only       # results JSON -> docs

A row records the transformers version it ran with: a page merged from runs on two
versions says so in its summary.

Writes ``benchmarks/results/compat.json`` and ``docs/compatibility.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from compat_cells import RTOL, Cell, capture_cell, classify, compare, train_parallel  # noqa: E402
from compat_families import (NotBuildable, build, eager_loss, family_names, grad_rtol, is_zoo,  # noqa: E402
                             reference, zoo_names)
from compat_render import render  # noqa: E402
from compat_world import run_jobs  # noqa: E402

COLUMNS = {"tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2), "pp2vocab": (1, 2)}
"""Column -> (tp, pp)."""
VOCAB_PASSES = ("pp2vocab",)
"""Columns run with ``vocab_passes=True``: the LM head as vocabulary passes."""
RESULTS = os.path.join(HERE, "results", "compat.json")
NOTES = os.path.join(HERE, "compat_notes.md")
DOC = os.path.join(os.path.dirname(HERE), "docs", "compatibility.md")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def _time_limit(seconds: float):
    """TimeoutError in this (main) thread after ``seconds``: a family whose capture runs
    away must not stop the others."""
    def expire(signum, frame):
        raise TimeoutError(f"no result within {seconds:.0f} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def select(spec: str | None) -> list[str]:
    """``--families``: names, ``hf`` for every transformers family, ``zoo`` for the zoo."""
    groups = {"hf": family_names, "zoo": zoo_names}
    names: list[str] = []
    for item in (spec.split(",") if spec else list(groups)):
        for name in groups[item]() if item in groups else [item]:
            if name not in names:
                names.append(name)
    return names


def local_phase(families: list[str], rows: dict, refs: dict, timeout_s: float) -> None:
    """Build, capture and TP-analyse each family here; keep the one-process reference."""
    import transformers

    for i, mt in enumerate(families, 1):
        start = time.perf_counter()
        try:
            with _time_limit(timeout_s):
                _local_family(mt, rows, refs)
        except TimeoutError as exc:
            rows[mt] = {"built": True, "capture": Cell("timeout", str(exc)).to_json(),
                        **{col: Cell("skipped", "capture did not pass").to_json() for col in COLUMNS}}
            refs.pop(mt, None)
        if not is_zoo(mt):
            rows[mt]["transformers"] = transformers.__version__
        log(f"[capture {i}/{len(families)}] {mt}: " + (
            f"{rows[mt]['capture']['status']} {rows[mt]['capture']['detail']}" if rows[mt]["built"]
            else f"not built ({rows[mt]['reason']})") + f" ({time.perf_counter() - start:.1f} s)")


def _local_family(mt: str, rows: dict, refs: dict) -> None:
    try:
        with torch.no_grad():
            eager_loss(build(mt))  # a family that fails eagerly is no test of fxpipe
    except NotBuildable as exc:
        rows[mt] = {"built": False, "reason": str(exc)}
        return
    except TimeoutError:
        raise
    except Exception as exc:
        rows[mt] = {"built": False, "reason": f"eager forward fails: {classify(exc).detail}"}
        return
    cap, tp_analysis = capture_cell(mt)
    row = rows[mt] = {"built": True, "capture": cap.to_json()}
    if cap.status != "pass":
        for col in COLUMNS:
            row[col] = Cell("skipped", "capture did not pass").to_json()
    else:
        refs[mt] = reference(mt, lr=0.1)
        row["tp_analysis"] = tp_analysis.to_json() if tp_analysis else None


def parallel_phase(world: int, columns: list[str], families: list[str], rows: dict, refs: dict,
                   timeout_s: float, save: Callable[[], None]) -> None:
    jobs, keys = [], []
    for mt in families:
        row = rows.get(mt, {})
        if not row.get("built") or row["capture"]["status"] != "pass":
            continue
        for col in columns:
            tp, pp = COLUMNS[col]
            analysis = row.get("tp_analysis") or {}
            if tp > 1 and analysis.get("status") in ("refused", "error"):
                # The TP pass already refused in this process: the world would say the same.
                row[col] = {**analysis, "detail": analysis["detail"] + " (TP pass, tp=2)"}
                continue
            if col == "tp2xpp2" and any(row.get(c, {}).get("status") in ("refused", "error")
                                        for c in ("tp2", "pp2")):
                bad = next(c for c in ("tp2", "pp2") if row[c]["status"] in ("refused", "error"))
                row[col] = Cell("skipped", f"{bad} failed").to_json()
                continue
            jobs.append((mt, tp, pp, timeout_s / 2, col in VOCAB_PASSES))
            keys.append((mt, col))
    started = [time.perf_counter()]

    def done(index: int, per_rank: list | None) -> None:
        mt, col = keys[index]
        seconds = time.perf_counter() - started[0]
        started[0] = time.perf_counter()
        if per_rank is None:
            cell = Cell("timeout", f"no result within {timeout_s:.0f} s")
        else:
            failed = [r for r in per_rank if r[0] == "exc"]
            if failed:
                cell = classify(failed[0][1], failed[0][2])
            else:
                result = per_rank[0][1]
                ref_losses, ref_grads = refs[mt]
                diff = compare(result["losses"], result["grads"], ref_losses, ref_grads,
                               grad_rtol(mt, RTOL))
                cell = Cell("mismatch", diff) if diff else Cell("pass")
                if COLUMNS[col][0] > 1:
                    analysis = rows[mt].get("tp_analysis") or {}
                    if not diff and analysis.get("replicated"):
                        cell = Cell("replicated", replicated=analysis["replicated"])
                    # Every rank holds the same local shapes: rank 0's share is the largest.
                    cell.share = analysis.get("share")
        cell.seconds = seconds
        rows[mt][col] = cell.to_json()
        save()
        log(f"[{col} {index + 1}/{len(jobs)}] {mt}: {cell.status} {cell.detail} ({seconds:.1f} s)")

    if jobs:
        run_jobs(world, train_parallel, jobs, timeout_s, done)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", help="comma-separated model types and zoo:<name>s; 'hf': every "
                    "transformers family, 'zoo': every zoo model (default: hf,zoo)")
    ap.add_argument("--merge", action="store_true", help="keep other families' rows from the JSON")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per family and column")
    ap.add_argument("--capture-timeout", type=float, default=120.0,
                    help="seconds per family for build + capture + reference in this process")
    ap.add_argument("--columns", default=",".join(COLUMNS), help="parallel columns to run")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--out", default=DOC)
    args = ap.parse_args(argv)
    data = {"rows": {}}
    if (args.merge or args.render_only) and os.path.exists(RESULTS):
        with open(RESULTS) as f:
            data = json.load(f)
    if not args.render_only:
        torch.set_num_threads(max(1, (os.cpu_count() or 1)))
        families = select(args.families)
        rows: dict = data["rows"]  # filled in place, saved after every cell
        refs: dict = {}
        t0 = time.perf_counter()
        old_meta = data.get("meta")

        def save() -> None:
            data["meta"] = _meta(time.perf_counter() - t0, old_meta, bool(args.merge))
            os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
            with open(RESULTS + ".tmp", "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(RESULTS + ".tmp", RESULTS)

        columns = [c for c in args.columns.split(",") if c]
        before = {mt: dict(rows[mt]) for mt in families if mt in rows}
        local_phase(families, rows, refs, args.capture_timeout)
        for mt, old in before.items():
            if rows[mt].get("built") and rows[mt]["capture"]["status"] == "pass":
                _keep_cells(rows[mt], old, columns)
        save()
        for world in sorted({COLUMNS[c][0] * COLUMNS[c][1] for c in columns}):
            cols = [c for c in columns if COLUMNS[c][0] * COLUMNS[c][1] == world]
            parallel_phase(world, cols, families, rows, refs, args.timeout, save)
        save()
    notes = ""
    if os.path.exists(NOTES):
        with open(NOTES) as f:
            notes = f.read()
    with open(args.out, "w") as f:
        f.write(render(data, notes))
    log(f"wrote {os.path.relpath(args.out)} and {os.path.relpath(RESULTS)}")


def _keep_cells(row: dict, old: dict, columns: list[str]) -> None:
    """``--columns``: the columns not run keep their cells. A kept tp cell that passed
    takes the share of this run's TP analysis only when the analysis left the same
    weight matrices whole for the same reasons (the same sharding as when it ran)."""
    analysis = row.get("tp_analysis") or {}
    for col in COLUMNS:
        if col in columns or col not in old:
            continue
        cell = row[col] = dict(old[col])
        if COLUMNS[col][0] > 1 and cell.get("status") in ("pass", "replicated") and \
                analysis.get("status") == "pass" and \
                [list(r) for r in analysis.get("replicated") or []] == [list(r) for r in cell.get("replicated") or []]:
            cell["share"] = analysis.get("share")


def _meta(seconds: float, old: dict | None, merged: bool) -> dict:
    import platform

    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
            "seconds": round(seconds + (old or {}).get("seconds", 0) * merged, 1)}


if __name__ == "__main__":
    main()
