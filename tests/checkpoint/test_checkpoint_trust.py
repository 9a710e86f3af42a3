"""A checkpoint directory as hostile input, in this process (no process group, no model):
nothing is read or written through a link, a FIFO or a device never hangs or floods a
reader, the manifest's own content is digest-covered, and pruning deletes only the
saving run's checkpoints. Each case asserts what stayed on disk byte for byte, or the
message naming the path."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fxpipe.checkpoint import files as checkpoint_files
from fxpipe.checkpoint import lock as checkpoint_lock
from fxpipe.checkpoint.dcp import candidates, local_problems, pick_intact
from fxpipe.checkpoint.files import (list_checkpoints, latest_checkpoint, prune, read_pointer,
                                             remove_other_runs, step_dirname, write_atomic)
from fxpipe.checkpoint.lock import CheckpointLockError
from fxpipe.checkpoint.manifest import CorruptCheckpointError, read_manifest
from fxpipe.base.safe_io import UnsafeFileError, read_bounded
from tests.checkpoint._ckpt_files import RUN_A, RUN_B, edit_manifest, make_checkpoint
from tests._shared import within


def _resume_choice(root: Path, step: int | None = None):
    paths, notes = candidates(root, step)
    return pick_intact(paths, local_problems, strict=step is not None, notes=notes)


@pytest.fixture
def two_steps(tmp_path) -> Path:
    root = tmp_path / "ck"
    make_checkpoint(root, 1)
    make_checkpoint(root, 2)
    return root


@pytest.fixture
def victim(tmp_path) -> Path:
    f = tmp_path / "victim.txt"
    f.write_bytes(b"precious\n")
    return f


# ---- safe_io ---------------------------------------------------------------------------------
def test_dev_zero_is_refused_at_once():
    t0 = time.perf_counter()
    with pytest.raises(UnsafeFileError, match="/dev/zero is a character device"):
        read_bounded("/dev/zero", 1 << 20)
    assert time.perf_counter() - t0 < 1


def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafeFileError, match="fifo is a FIFO"):
        within(5, read_bounded, tmp_path / "fifo", 100)


def test_link_is_refused_only_where_links_are_not_followed(tmp_path, victim):
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(UnsafeFileError, match="link is a symbolic link"):
        read_bounded(tmp_path / "link", 100, follow=False)
    assert read_bounded(tmp_path / "link", 100) == b"precious\n"


def test_over_the_cap_and_directories_are_refused(tmp_path, victim):
    with pytest.raises(UnsafeFileError, match="is 9 bytes, over the 8-byte limit"):
        read_bounded(victim, 8)
    with pytest.raises(UnsafeFileError, match="is a directory"):
        read_bounded(tmp_path, 8)


# ---- the lock: never written through a link --------------------------------------------------
def test_lock_that_is_a_link_is_refused_and_its_target_unchanged(tmp_path, victim):
    root = tmp_path / "ck"
    root.mkdir()
    (root / ".lock").symlink_to(victim)
    with pytest.raises(CheckpointLockError, match=r"ck/\.lock is a symbolic link"):
        checkpoint_lock.acquire(root)
    with pytest.raises(CheckpointLockError, match="symbolic link"):
        checkpoint_lock.check_free(root)
    assert victim.read_bytes() == b"precious\n"
    assert str(root.resolve()) not in checkpoint_lock._HELD


def test_lock_that_is_a_fifo_is_refused_without_hanging(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    os.mkfifo(root / ".lock")
    with pytest.raises(CheckpointLockError, match="not a regular file"):
        within(5, checkpoint_lock.check_free, root)
    with pytest.raises(CheckpointLockError, match="not a regular file"):
        within(5, checkpoint_lock.acquire, root)


# ---- the pointer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make, why", [
    (lambda p: p.symlink_to("/dev/zero"), "is a symbolic link"),
    (lambda p: os.mkfifo(p), "is a FIFO"),
    (lambda p: p.symlink_to(p.parent.parent / "outside"), "is a symbolic link"),
])
def test_unusable_latest_is_refused_at_once_and_the_newest_taken(two_steps, make, why):
    """Reproduction 3: ``latest`` -> /dev/zero, or a FIFO: refused at once, never read."""
    (two_steps.parent / "outside").write_text("step_0000001\n")
    (two_steps / "latest").unlink()
    make(two_steps / "latest")
    target, note = within(5, read_pointer, two_steps)
    assert target is None and str(two_steps / "latest") in note and why in note
    assert within(5, latest_checkpoint, two_steps) == two_steps / step_dirname(2)
    chosen, skipped = within(5, _resume_choice, two_steps)
    assert chosen == two_steps / step_dirname(2) and why in skipped[0]


def test_latest_naming_a_linked_step_is_not_followed(two_steps, tmp_path):
    elsewhere = make_checkpoint(tmp_path / "other", 7)
    (two_steps / step_dirname(7)).symlink_to(elsewhere, target_is_directory=True)
    (two_steps / "latest").write_text(step_dirname(7))
    target, note = read_pointer(two_steps)
    assert target is None and "step_0000007, which is a symbolic link" in note


# ---- step directories and their files --------------------------------------------------------
def test_step_directory_that_is_a_link_out_is_never_loaded(two_steps, tmp_path):
    elsewhere = make_checkpoint(tmp_path / "other", 9)
    (two_steps / step_dirname(9)).symlink_to(elsewhere, target_is_directory=True)
    (two_steps / "latest").write_text(step_dirname(9))
    assert [s for s, _ in list_checkpoints(two_steps)] == [1, 2]
    assert latest_checkpoint(two_steps) == two_steps / step_dirname(2)
    chosen, skipped = _resume_choice(two_steps)  # the newest name is tried first, and named
    assert chosen == two_steps / step_dirname(2)
    assert any(n.startswith(f"{step_dirname(9)}: ") and "is a symbolic link" in n for n in skipped), skipped
    with pytest.raises(FileNotFoundError, match="step_0000009 is a symbolic link"):
        _resume_choice(two_steps, 9)  # --resume-from 9


@pytest.mark.parametrize("name", ["fxpipe.json", ".metadata", "__0_0.distcp"])
def test_file_that_is_a_link_is_refused_though_its_bytes_match(two_steps, tmp_path, name):
    """The link points at an exact copy (every digest would match): refused all the same."""
    f = two_steps / step_dirname(2) / name
    copy = tmp_path / f"copy-{name}"
    copy.write_bytes(f.read_bytes())
    f.unlink()
    f.symlink_to(copy)
    problems = local_problems(two_steps / step_dirname(2))
    assert problems and str(f) in problems[0] and "symbolic link" in problems[0], problems
    assert _resume_choice(two_steps)[0] == two_steps / step_dirname(1)


@pytest.mark.parametrize("name", ["fxpipe.json", "__0_0.distcp"])
def test_file_that_is_a_fifo_is_refused_without_hanging(two_steps, name):
    f = two_steps / step_dirname(2) / name
    f.unlink()
    os.mkfifo(f)
    problems = within(5, local_problems, two_steps / step_dirname(2))
    assert problems and "FIFO" in problems[0], problems
    assert within(5, _resume_choice, two_steps)[0] == two_steps / step_dirname(1)


def test_atomic_write_never_writes_through_a_link(tmp_path, victim):
    """A link planted at the temporary's name, and a link at the destination: both replaced
    as names, the file they point at untouched."""
    root = tmp_path / "ck"
    root.mkdir()
    (root / f".latest.{os.getpid()}.tmp").symlink_to(victim)
    (root / "latest").symlink_to(victim)
    write_atomic(root / "latest", b"step_0000001\n")
    assert victim.read_bytes() == b"precious\n"
    assert not (root / "latest").is_symlink() and (root / "latest").read_bytes() == b"step_0000001\n"


# ---- the manifest's own digest --------------------------------------------------
@pytest.mark.parametrize("change", [
    dict(extra={"lr_scheduler": {"base_lrs": [2e6], "last_epoch": 2, "_last_lr": [2e6]}}),
    dict(source="Other"),
    dict(state_dict={"w": "w", "v": "w"}),
    dict(loss_scaler={"scale": 2.0, "good_steps": 0, "skipped": 0}),
])
def test_an_edited_manifest_is_corrupt_and_the_resume_falls_back(two_steps, change):
    """Every field is covered: a tampered ``extra.lr_scheduler.base_lrs`` (type-valid, so
    the field checks pass) is refused as corrupt, and the resume takes step 1."""
    edit_manifest(two_steps / step_dirname(2), **change)
    with pytest.raises(CorruptCheckpointError, match="does not match its own SHA-256"):
        read_manifest(two_steps / step_dirname(2))
    chosen, skipped = _resume_choice(two_steps)
    assert chosen == two_steps / step_dirname(1)
    assert skipped == [f"{step_dirname(2)}: {two_steps / step_dirname(2) / 'fxpipe.json'}: does not match its "
                       f"own SHA-256 (a field, e.g. extra, was edited or corrupted)"]
    with pytest.raises(FileNotFoundError, match="no complete checkpoint for step 2 .*own SHA-256"):
        _resume_choice(two_steps, 2)  # --resume-from 2: refused, naming why


def test_every_step_tampered_is_a_clear_error(two_steps):
    for s in (1, 2):
        edit_manifest(two_steps / step_dirname(s), source="Other")
    with pytest.raises(CorruptCheckpointError, match=r"no intact checkpoint in .*step_0000002: .*own SHA-256"):
        _resume_choice(two_steps)


# ---- a directory belongs to one run: pruning ---------------------------------------------------
def test_pruning_deletes_only_its_own_runs_checkpoints(tmp_path):
    """Reproduction 2's loss: run B saving into run A's directory keeps its own last 2 and
    never deletes A's."""
    root = tmp_path / "ck"
    a = [make_checkpoint(root, s, run=RUN_A) for s in (1, 2)]
    before = {p: sorted((f.name, f.read_bytes()) for f in p.iterdir()) for p in a}
    for s in (3, 4, 5):
        make_checkpoint(root, s, run=RUN_B)
        prune(root, keep_last=2, keep=root / step_dirname(s), run=RUN_B)
    assert [s for s, _ in list_checkpoints(root)] == [1, 2, 4, 5]
    assert {p: sorted((f.name, f.read_bytes()) for f in p.iterdir()) for p in a} == before


def test_pruning_never_deletes_a_checkpoint_of_unknown_run(tmp_path):
    root = tmp_path / "ck"
    make_checkpoint(root, 1, run=RUN_A)
    (root / step_dirname(1) / "fxpipe.json").write_text("{garbage")  # run unreadable
    for s in (2, 3, 4):
        make_checkpoint(root, s, run=RUN_A)
        prune(root, keep_last=1, keep=root / step_dirname(s), run=RUN_A)
    assert sorted(p.name for p in root.glob("step_*")) == [step_dirname(1), step_dirname(4)]


def test_overwrite_removes_the_other_runs_but_never_follows_a_link(tmp_path):
    root = tmp_path / "ck"
    make_checkpoint(root, 1, run=RUN_A)
    make_checkpoint(root, 2, run=RUN_A)
    outside = make_checkpoint(tmp_path / "elsewhere", 8, run=RUN_A)
    (root / step_dirname(8)).symlink_to(outside, target_is_directory=True)
    mine = make_checkpoint(root, 3, run=RUN_B)
    assert remove_other_runs(root, RUN_B, keep=mine) == [step_dirname(1), step_dirname(2)]
    assert sorted(p.name for p in root.glob("step_*")) == [step_dirname(3), step_dirname(8)]
    assert (outside / "fxpipe.json").is_file(), "the link's target is not ours to delete"


def test_a_resume_continues_the_run_it_loaded(tmp_path):
    root = tmp_path / "ck"
    fresh = checkpoint_files.run_id(root)
    assert fresh == checkpoint_files.run_id(root), "one run per process and directory"
    checkpoint_files.adopt_run(root, RUN_A)
    assert checkpoint_files.run_id(root) == RUN_A
    checkpoint_files.adopt_run(root, None)  # a format without runs: keeps the current one
    assert checkpoint_files.run_id(root) == RUN_A
