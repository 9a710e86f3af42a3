"""`fxpipe run`: bad flags fail before any process starts; a short job trains."""
import re
import subprocess
import sys

import pytest

from fxpipe.cli import main
from fxpipe.data import DataStream, PackedWindows, stdlib_stream


def test_builtin_batches_are_a_function_of_seed_and_position():
    windows = PackedWindows(stdlib_stream(1 << 20), seq=16)
    a, b = DataStream(windows, 3, seed=1), DataStream(windows, 3, seed=1)
    assert all((a.next_batch() == b.next_batch()).all() for _ in range(3))
    assert not (DataStream(windows, 3, seed=2).next_batch() == a.next_batch()).all()


@pytest.mark.parametrize("argv,message", [
    (["--global-batch", "10"], "global batch 10"),
    (["--schedule", "nope"], "valid names are: gpipe, 1f1b"),
    (["--model", "nope"], "unknown model"),
    (["--eval-interval", "5", "--val-fraction", "0"], "--eval-interval needs validation data"),
    (["--seq", "100000"], "exceeds gpt-small's block size"),
])
def test_bad_flags_fail_fast(capsys, argv, message):
    assert main(["run", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_short_run_trains(tmp_path):
    """Two workers through the elastic launcher; the loss falls within a few steps."""
    prefix = tmp_path / "tl"
    out = subprocess.run(
        [sys.executable, "-m", "fxpipe", "run", "--model", "gpt-tiny", "--seq", "64", "--steps", "8",
         "--log-interval", "1", "--lr", "3e-3", "--timeline", str(prefix)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+) \|", out.stdout)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, out.stdout
    assert "tokens/s" in out.stdout and "TFLOP/s/process" in out.stdout and "bubble" in out.stdout
    # Per-stage predicted vs measured times, one row per stage (tp=2 x pp=2: two stages).
    table = re.search(r"stage balance.*?\n(?:.*\n){1}((?:\s+\d+\s+\d+(?:\s+[0-9.]+){5}\n){2})"
                      r"measured imbalance .*: ([0-9.]+)", out.stdout)
    assert table, out.stdout
    assert float(table.group(2)) >= 1.0
    assert "costs: timing" in out.stderr or "costs: reusing" in out.stderr
    assert (tmp_path / "tl.json").exists() and (tmp_path / "tl.png").exists()
