"""No hangs: timeouts on every transfer; a failing worker ends the job with its error."""
import subprocess
import sys
import time

import pytest

from tests.runtime._cases import stall_peer, wrong_shapes
from tests.runtime._dist import run_world


@pytest.mark.slow
def test_stalled_peer_times_out():
    out = run_world(2, stall_peer, 3.0)
    err = out[0]["error"]
    # The waiting rank names the rank that did not answer, not only its own receive.
    assert err is not None and err.startswith("PeerError: rank 0 receiving"), err
    assert "from rank 1: timed out after 3 s: rank 1 did not answer" in err, err
    assert out[0]["elapsed"] < 3.0 + 3.0


@pytest.mark.slow
def test_wrong_batch_shape_is_a_clear_error():
    out = run_world(2, wrong_shapes)
    assert all("expected (8, 16)" in r["error"] for r in out), out


@pytest.mark.slow
def test_failing_worker_ends_the_job_with_its_error():
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "fxpipe", "run", "--model", "tests.runtime._faulty:build",
                          "--seq", "16", "--steps", "2", "--timeout", "60", "--timeline", "none", "--tp", "1"],
                         capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert res.returncode != 0
    # One line naming the failed rank and its error; no worker's traceback.
    assert "fxpipe run: rank 1 failed: RuntimeError: injected failure on rank 1" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 3, res.stderr
    assert elapsed < 60, "the launcher tore the job down before the 60 s transfer timeout"
