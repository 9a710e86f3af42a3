"""Checkpoint directories under faults: two jobs, and corruption of every kind of file.
The directory protocol is driven with a plain state dict by one-process children
(tests/checkpoint/_ckpt_child.py), so each scenario costs a process start, not a model
compile. kill -9 at any moment of a save or a prune: test_checkpoint_kills.py.

What every scenario checks is the guarantee of docs/checkpoints.md: every checkpoint
that ``list_checkpoints`` reports is intact (each file's digest matches, DCP loads it
and it holds the values of its step), and a resume takes the newest intact one.
"""
from __future__ import annotations

import json
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch

from fxpipe.checkpoint import files as checkpoint_files
from fxpipe.checkpoint.dcp import read_dcp
from fxpipe.checkpoint.files import latest_checkpoint, list_checkpoints, step_dirname
from fxpipe.checkpoint.lock import CheckpointLockError, check_free
from fxpipe.checkpoint.manifest import CorruptCheckpointError, with_digest
from tests.checkpoint._ckpt_child import state
from tests.checkpoint._fault_checks import child as _child
from tests.checkpoint._fault_checks import loads_its_step as _loads_its_step
from tests.checkpoint._fault_checks import resume_choice as _resume_choice
from tests.checkpoint._fault_checks import run_child as _run



@pytest.fixture(scope="module")
def three_steps(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults") / "ckpt"
    assert _run("save", str(root), "1", "2", "3") == "OK"
    return root


@pytest.fixture
def ckpt(three_steps, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(three_steps, copy)
    return copy


# ---- two jobs ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_second_job_is_refused_and_a_dead_holder_is_recovered(tmp_path):
    root = tmp_path / "ckpt"
    holder = _child("hold", str(root))
    try:
        assert holder.stdout.readline().strip() == "HELD"
        out = _run("save", str(root), "2")
        assert out.startswith("ERROR CheckpointLockError") and f"pid {holder.pid}" in out, out
        with pytest.raises(CheckpointLockError, match=f"in use by another fxpipe job \\(pid {holder.pid}"):
            check_free(root)  # what the launcher checks before spawning
        assert [s for s, _ in list_checkpoints(root)] == [1], "the refused job touched nothing"
        _loads_its_step(root / step_dirname(1))
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding the lock
        holder.communicate(timeout=30)
    check_free(root)  # the kernel released the dead job's lock
    assert _run("save", str(root), "2") == "OK"
    assert [s for s, _ in list_checkpoints(root)] == [1, 2]


def test_half_deleted_checkpoint_is_never_listed(ckpt, monkeypatch):
    """Pruning renames a checkpoint out of the step_N namespace before deleting it: a
    kill in the middle of the deletion leaves debris, not a 'complete' step with half
    its files (what deleting in place left)."""
    def dies_halfway(path, ignore_errors=False):
        next(Path(path).glob("*.distcp")).unlink()
        raise KeyboardInterrupt  # the kill

    monkeypatch.setattr(checkpoint_files.shutil, "rmtree", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_files.prune(ckpt, keep_last=2, keep=ckpt / step_dirname(3),
                               run=checkpoint_files.run_of(ckpt / step_dirname(3)))
    assert [s for s, _ in list_checkpoints(ckpt)] == [2, 3]
    assert len(list(ckpt.glob("step_0000001.*.deleting.tmp"))) == 1


def test_manifest_lists_every_file_and_a_missing_one_makes_it_incomplete(ckpt):
    path = ckpt / step_dirname(3)
    next(path.glob("*.distcp")).unlink()
    assert [s for s, _ in list_checkpoints(ckpt)] == [1, 2]
    assert latest_checkpoint(ckpt) == ckpt / step_dirname(2), "latest names an incomplete one: fall back"
    chosen, skipped = _resume_choice(ckpt)
    assert chosen == ckpt / step_dirname(2)
    assert skipped == [f"{step_dirname(3)}: {path / '__0_0.distcp'} is missing"]


# ---- corruption of each kind of file ---------------------------------------------------------------
def _zeros_inside(f: Path) -> None:
    data = bytearray(f.read_bytes())
    n = min(2048, len(data) // 2)  # 2 KB of zeros inside (half of a smaller file), size unchanged
    start = len(data) // 4
    data[start:start + n] = bytes(n)
    f.write_bytes(bytes(data))


def _garbage(f: Path) -> None:
    f.write_bytes(b"\x00garbage" * 10)


@pytest.mark.parametrize("target,damage,message,listed", [
    ("__0_0.distcp", _zeros_inside, "__0_0.distcp does not match its SHA-256", True),
    ("__0_0.distcp", lambda f: f.write_bytes(f.read_bytes()[:-10]), "__0_0.distcp has ", False),  # truncated
    (".metadata", _zeros_inside, ".metadata does not match its SHA-256", True),
    ("fxpipe.json", _garbage, "fxpipe.json is not readable JSON", False),
    ("fxpipe.json", lambda f: f.write_text(f.read_text().replace('"step": 3', '"step": "3"')),
     "fxpipe.json: field 'step' is missing or malformed", False),
])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(ckpt, target, damage, message, listed):
    damage(ckpt / step_dirname(3) / target)
    path, skipped = _resume_choice(ckpt)
    assert path == ckpt / step_dirname(2)
    _loads_its_step(path)
    # The resume's warning names the damaged file, whether the damage is seen by a stat
    # (incomplete: not listed) or only by the digests (listed as complete).
    assert len(skipped) == 1 and message in skipped[0] and skipped[0].startswith(step_dirname(3)), skipped
    assert (3 in [s for s, _ in list_checkpoints(ckpt)]) == listed
    if listed:
        with pytest.raises(CorruptCheckpointError, match=message.split(" ")[0].replace(".", r"\.")):
            _resume_choice(ckpt, step=3)  # --resume-from 3: an error, not a silent fallback
    else:  # not even complete: asked for, the error names the file
        with pytest.raises(FileNotFoundError, match=f"step 3 .*{target.replace('.', '[.]')}"):
            _resume_choice(ckpt, step=3)


@pytest.mark.slow
def test_resume_warns_naming_the_files_and_resume_from_refuses(ckpt):
    """The collective choice ``load_checkpoint`` makes (a world of one): the warning
    names the damaged file and the unusable pointer; an explicit step errors."""
    _zeros_inside(ckpt / step_dirname(3) / "__0_0.distcp")
    (ckpt / "latest").write_text("step_3/../..\n")
    lines = _run("choose", str(ckpt), "latest", "3", "2").splitlines()
    assert lines[0] == f"CHOSE {step_dirname(2)}", lines
    assert lines[1].startswith("WARN CheckpointFallbackWarning: resuming from "), lines
    assert f"{ckpt / 'latest'} does not name a step directory" in lines[1]
    assert f"{step_dirname(3)}: {ckpt / step_dirname(3) / '__0_0.distcp'} does not match its SHA-256" in lines[1]
    assert lines[2].startswith(f"ERROR CorruptCheckpointError: checkpoint {ckpt / step_dirname(3)} is corrupt: "
                               f"{ckpt / step_dirname(3) / '__0_0.distcp'} does not match"), lines
    assert lines[3:] == [f"CHOSE {step_dirname(2)}"], "an explicit intact step: no warning"


def _edit_manifest(**changes):
    """The manifest with ``changes`` and its own digest recomputed, so that the field
    checks (not the digest) must catch them."""
    def edit(f: Path) -> None:
        meta = json.loads(f.read_text())
        meta.update(changes)
        f.write_text(json.dumps(with_digest(meta)))
    return edit


def _raw(text: str):
    return lambda f: f.write_text(text)


def _drop_file_entry(f: Path) -> None:
    meta = json.loads(f.read_text())
    del meta["files"]["__0_0.distcp"]
    f.write_text(json.dumps(with_digest(meta)))


@pytest.mark.parametrize("damage,message", [
    (_raw("[" * 100_000), "fxpipe.json is not readable JSON (RecursionError"),
    (_raw('{"format": 2, "step": NaN}'), "fxpipe.json is not readable JSON (ValueError: non-finite number NaN"),
    (lambda f: f.write_bytes(b"\xff\xfe{}"), "fxpipe.json is not readable JSON (UnicodeDecodeError"),
    (_raw("[1, 2]"), "fxpipe.json: is not a JSON object"),
    (_edit_manifest(format=True), "fxpipe.json: has format 'True'"),
    (_edit_manifest(format=4), "fxpipe.json: has format '4'; this fxpipe reads 1, 2, 3"),
    (_edit_manifest(step=2), "fxpipe.json: says step 2, but it is in step_0000003"),
    (_edit_manifest(step=True), "fxpipe.json: field 'step' is missing or malformed"),
    (_edit_manifest(world_size=2), "fxpipe.json: mesh {'pp': 1, 'dp': 1, 'tp': 1} does not multiply to its "
                                   "world size 2"),
    (_edit_manifest(mesh={"pp": 1, "dp": 0, "tp": 1}), "fxpipe.json: field 'mesh' is missing or malformed"),
    (_edit_manifest(loss_scaler={"scale": 1.0}), "fxpipe.json: field 'loss_scaler' is missing or malformed"),
    (_edit_manifest(loss_scaler={"scale": -1.0, "good_steps": 0, "skipped": 0}), "field 'loss_scaler'"),
    (_edit_manifest(loss_scaler={"scale": 1e400, "good_steps": 0, "skipped": 0}), "non-finite number Infinity"),
    (_edit_manifest(precision="fp8"), "fxpipe.json: field 'precision' is missing or malformed"),
    (_edit_manifest(state_dict={"w": 3}), "fxpipe.json: field 'state_dict' is missing or malformed"),
    (_edit_manifest(files={".metadata": {"bytes": 1, "sha256": "0" * 64}, "../x.distcp": {}}),
     "fxpipe.json: field 'files' is missing or malformed"),
    (_edit_manifest(files={}), "fxpipe.json: field 'files' is missing or malformed"),
    (_drop_file_entry, "refers to ['__0_0.distcp'], which"),  # data that no digest covers
])
def test_hostile_manifest_is_refused_naming_the_field(ckpt, damage, message):
    """fxpipe.json is read as hostile input: every field's type and range is checked
    before use (one line per case), and the resume falls back to the previous step."""
    damage(ckpt / step_dirname(3) / "fxpipe.json")
    path, skipped = _resume_choice(ckpt)
    assert path == ckpt / step_dirname(2)
    assert len(skipped) == 1 and skipped[0].startswith(step_dirname(3)) and message in skipped[0], skipped


def test_a_failed_dcp_read_is_an_error_naming_the_checkpoint(ckpt):
    """DCP raises CheckpointException (a BaseException): turned into an Exception that
    names the checkpoint (a file damaged after verification, or format 1: no digests)."""
    path = ckpt / step_dirname(3)
    f = path / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    targets = {k: torch.empty_like(v) for k, v in state(3).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CorruptCheckpointError, match=f"checkpoint {path} could not be read"):
            read_dcp(targets, path, no_dist=True)


def test_corrupt_latest_pointer_falls_back_to_the_newest(ckpt):
    (ckpt / "latest").write_bytes(b"\xff\xfe../../etc\n")
    assert latest_checkpoint(ckpt) == ckpt / step_dirname(3)
    chosen, skipped = _resume_choice(ckpt)
    assert chosen == ckpt / step_dirname(3)
    assert len(skipped) == 1 and skipped[0].startswith(f"{ckpt / 'latest'} does not name a step directory")
    (ckpt / "latest").write_text(step_dirname(9) + "\n")
    assert _resume_choice(ckpt)[1] == [f"{ckpt / 'latest'} names {step_dirname(9)}, which does not exist"]
    (ckpt / "latest").write_text(step_dirname(1) + "\n")  # a valid but older pointer wins
    assert _resume_choice(ckpt)[0] == ckpt / step_dirname(1)


def test_every_checkpoint_corrupt_is_a_clear_error(ckpt):
    for s in (1, 2, 3):
        _zeros_inside(ckpt / step_dirname(s) / "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match="no intact checkpoint in .*step_0000003: .*SHA-256"):
        _resume_choice(ckpt)


def test_resume_from_a_step_that_is_not_there(ckpt):
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint for step 7 .*\[1, 2, 3\]"):
        _resume_choice(ckpt, step=7)
