"""kill -9 at any moment of a checkpoint save or prune (see test_checkpoint_faults.py for
the guarantee checked). Its own file: its children's starts take as long as the rest of
the fault tests, and pytest-xdist places one file per worker."""
from __future__ import annotations

import time

import pytest

from fxpipe.checkpoint.files import latest_checkpoint, list_checkpoints
from tests.checkpoint._fault_checks import child as _child
from tests.checkpoint._fault_checks import loads_its_step as _loads_its_step
from tests.checkpoint._fault_checks import resume_choice as _resume_choice


# ---- kill -9 anywhere in the save / prune cycle -------------------------------------------------
@pytest.mark.slow
def test_kill_at_any_moment_leaves_only_intact_checkpoints(tmp_path):
    """A child saves steps 1, 2, 3 ... keeping the last 2 (each save prunes one), killed
    at delays spread over a whole save-and-prune cycle; the next child continues in the
    same directory (clearing the debris, taking over the dead one's lock)."""
    root = tmp_path / "ckpt"
    proc = _child("loop", str(root))
    t0 = time.perf_counter()
    lines = [proc.stdout.readline() for _ in range(3)]  # three cycles: time one
    cycle = (time.perf_counter() - t0) / 3
    if not all(line.startswith("SAVED") for line in lines):
        proc.kill()
        raise AssertionError(lines)
    # The timing child is also the kill at fraction 0 (right after a save returned, as the
    # children below are after their first): one child start fewer (~6 s of CPU); the
    # four later children continue in the directory it left.
    seen_debris = False
    for fraction in (0.0, 0.3, 0.6, 0.9, 1.05):
        if fraction:
            proc = _child("loop", str(root))
            assert proc.stdout.readline().startswith("SAVED")  # a cycle starts now
        time.sleep(cycle * fraction)
        proc.kill()
        proc.communicate(timeout=30)
        seen_debris |= any(root.glob("*.tmp"))
        found = list_checkpoints(root)
        assert found, "a complete checkpoint always survives"
        for _, path in found:
            _loads_its_step(path)
        # A kill between the rename of step_N+1 and the update of ``latest`` leaves both;
        # the pointer still names step_N, and a resume takes it (the save of N+1 never
        # returned; saving N+1 again replaces the orphan). Otherwise it names the newest.
        chosen, _ = _resume_choice(root)
        assert chosen == latest_checkpoint(root) and chosen in [p for _, p in found[-2:]], (chosen, found)
    assert seen_debris, "some kills landed inside a save or a prune"
