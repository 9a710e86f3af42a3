"""``fxpipe run`` with checkpoints, end to end: an open-ended job killed mid-run and resumed
in another layout equals an uninterrupted one, and Ctrl-C stops at a step boundary and saves.

Its own file (split from test_checkpoint.py): the three launches take as long as that
file's spawned worlds, and pytest-xdist places one file per worker.
"""
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fxpipe.checkpoint.dcp import list_checkpoints
from tests.data._corpus import write_corpus

ROOT = Path(__file__).resolve().parents[2]


FIRST = ("--tp", "1", "--pp", "1", "--dp", "2", "--micro-batch-size", "8", "--microbatches", "1")
OTHER = ("--tp", "2", "--pp", "2", "--dp", "1", "--micro-batch-size", "4", "--microbatches", "4")
"""Two layouts (2 and 4 ranks) with the same global batch (16): the resume changes layout."""


def _start(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fxpipe", "run", "--model", "gpt-tiny", "--seq", "32",
                             "--log-interval", "1", "--timeline", "none", "--partition", "uniform",
                             "--schedule", "1f1b", "--costs", "model", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


def _losses(stdout: str) -> dict[int, str]:
    return {int(i): loss for i, loss in re.findall(r"iter\s+(\d+) \| loss ([0-9.]+) \|", stdout)}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Three launches: an open-ended run on a Parquet dataset saving every 3 steps, killed
    (SIGKILL: no save) after step 7, --resume to 10 in another layout (tp 2 × pp 2 from
    dp 2) — the data stream must continue at the token after step 6's —, and
    alongside them an open-ended run on the same documents as .txt files stopped with
    Ctrl-C after step 10: the uninterrupted reference (the LR schedule and the batches do
    not depend on --steps)."""
    root = tmp_path_factory.mktemp("cli")
    texts = write_corpus(root / "texts", docs=40, words=150)
    (root / "txt").mkdir()
    for i, text in enumerate(texts):
        (root / "txt" / f"{i:03d}.txt").write_text(text)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(root / "docs.parquet"))
    parquet = ("--data", str(root / "docs.parquet"))
    # Ctrl-C signals the terminal's whole foreground process group: launcher and workers.
    endless = _start(*FIRST, "--data", str(root / "txt"), "--steps", "100000", "--checkpoint-dir",
                     str(root / "stopped"), start_new_session=True)
    first = _start(*FIRST, *parquet, "--steps", "100000", "--save-interval", "3", "--checkpoint-dir",
                   str(root / "ckpt"), start_new_session=True)
    killed: list[str] = []

    def kill_after_step_7() -> None:
        for line in first.stdout:
            killed.append(line)
            if line.startswith("iter     7 "):
                os.killpg(first.pid, signal.SIGKILL)  # launcher and workers, mid-run
                break

    watcher = threading.Thread(target=kill_after_step_7)
    watcher.start()
    try:
        head = []
        for line in endless.stdout:
            head.append(line)
            if line.startswith("iter    10 "):
                os.killpg(endless.pid, signal.SIGINT)
                break
        out, err = endless.communicate(timeout=60)
        watcher.join(timeout=300)
        first.communicate(timeout=60)
    finally:
        for proc in (endless, first):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    first = "".join(killed)
    kept_after_first = [s for s, _ in list_checkpoints(root / "ckpt")]
    second = _finish(_start(*OTHER, *parquet, "--steps", "10", "--checkpoint-dir", str(root / "ckpt"), "--resume",
                            "--export", str(root / "m.pt")))
    return dict(root=root, first=first, second=second, kept_after_first=kept_after_first,
                stopped=("".join(head) + out, err, endless.returncode))


@pytest.mark.slow
def test_fxpipe_run_resume_equals_an_uninterrupted_run(cli_runs):
    first, second = cli_runs["first"], cli_runs["second"]
    assert cli_runs["kept_after_first"] == [3, 6]
    assert sorted(_losses(second)) == [7, 8, 9, 10]
    reference = _losses(cli_runs["stopped"][0])
    # The Parquet rows are the .txt files' tokens: the same layout prints the same losses;
    # resumed under tp 2 × pp 2 they agree to fp32 reduction order.
    assert _losses(first) == {i: reference[i] for i in _losses(first)} and 7 in _losses(first)
    assert "tp=2 (sp) pp=2 dp=1" in second or "tp=2 pp=2 dp=1" in second
    assert [float(second_loss) for _, second_loss in sorted(_losses(second).items())] == \
        pytest.approx([float(reference[i]) for i in range(7, 11)], abs=2e-4)
    assert [s for s, _ in list_checkpoints(cli_runs["root"] / "ckpt")] == [3, 6, 10]
    assert (cli_runs["root"] / "m.pt").exists()
    # The data position (windows consumed: steps × global batch 4·4) is what the resume read
    # on from; the resolved config is saved beside the checkpoints.
    from fxpipe.checkpoint.manifest import read_manifest
    kept = dict(list_checkpoints(cli_runs["root"] / "ckpt"))
    assert [read_manifest(kept[s])["extra"]["data"]["position"] for s in (3, 6, 10)] == [48, 96, 160]
    assert 'model = "gpt-tiny"' in (cli_runs["root"] / "ckpt" / "fxpipe-run.toml").read_text()


@pytest.mark.slow
def test_ctrl_c_stops_at_a_step_boundary_and_saves(cli_runs):
    out, err, returncode = cli_runs["stopped"]
    assert returncode == 128 + signal.SIGINT, err[-3000:]
    found = re.search(r"stopped by SIGINT after step (\d+)", out)
    assert found, out[-2000:] + err[-3000:]
    stopped = int(found.group(1))
    assert stopped >= 10 and max(_losses(out)) == stopped, "stopped at a step boundary"
    assert [s for s, _ in list_checkpoints(cli_runs["root"] / "stopped")] == [stopped]
