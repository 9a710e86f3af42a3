"""``fxpipe run``'s refusals that must come before any worker,
through ``fxpipe.cli.main`` in this process with ``fxpipe.job.launcher.launch`` replaced by
a function that fails the test — or, where the input is fine, that records the config
the workers would get. Each case asserts the exit code, the one-line message naming
the numbers and paths, and what stayed on disk."""
from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch

import fxpipe.job.launcher
import fxpipe.job.preflight_files
from fxpipe import cli
from fxpipe.models import build_workload
from fxpipe.job.preflight_files import check_schedule
from fxpipe.checkpoint.files import step_dirname
from fxpipe.job.config import _batch_hint
from tests.checkpoint._ckpt_files import edit_manifest, make_checkpoint, schedule
from tests._shared import within
from tests.job._cli import RUN, TINY_NAMES, hf_weights, launched, refused, snapshot


# ---- links -------------------------------------------------------------------
def test_lock_link_leaves_its_target_unchanged(tmp_path, monkeypatch, capsys):
    """``ln -s victim.txt ck/.lock; fxpipe run --checkpoint-dir ck``."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".lock").symlink_to(victim)
    refused(RUN + ["--checkpoint-dir", tmp_path / "ck"], monkeypatch, capsys, f"{tmp_path}/ck/.lock is a symbolic link")
    assert victim.read_bytes() == b"precious\n"


# ---- one run per directory -----------------------------------------------------
def _other_run(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    names = tuple(f"transformer.h.{i}.ln_1.weight" for i in range(4))  # gpt-nano's: another model
    for s in (3, 6):
        make_checkpoint(root, s, names=names, source="GPT")
    return root


def test_second_run_of_another_model_is_refused_and_the_first_survives(tmp_path, monkeypatch, capsys):
    root = _other_run(tmp_path)
    before = snapshot(root)
    refused(RUN + ["--checkpoint-dir", root], monkeypatch, capsys,
             f"--checkpoint-dir {root} already holds checkpoints of another run (steps 3, 6; GPT)",
             "--resume", "--overwrite")
    assert snapshot(root) == before


def test_overwrite_means_it(tmp_path, monkeypatch, capsys):
    root = _other_run(tmp_path)
    config = launched(RUN + ["--checkpoint-dir", root, "--overwrite"], monkeypatch, capsys)
    assert config.overwrite and config.checkpoint_dir == str(root)


def test_resume_of_another_model_is_refused(tmp_path, monkeypatch, capsys):
    root = _other_run(tmp_path)
    refused(RUN + ["--checkpoint-dir", root, "--resume"], monkeypatch, capsys,
             "was saved from another model (GPT, 4 tensors)", "--model that saved it")


# ---- hostile files -------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda p: p.symlink_to("/dev/zero"), os.mkfifo], ids=["dev-zero", "fifo"])
def test_unusable_latest_is_refused_at_once(tmp_path, monkeypatch, capsys, make):
    """Only the pointer is bad: it is refused unread, and the resume takes the newest step."""
    root = tmp_path / "ck"
    make_checkpoint(root, 2, names=TINY_NAMES, source="GPT")
    (root / "latest").unlink()
    make(root / "latest")
    config = within(60, launched, RUN + ["--checkpoint-dir", root, "--resume"], monkeypatch, capsys)
    assert config.resume


@pytest.mark.parametrize("make", [lambda p: p.symlink_to("/dev/zero"), os.mkfifo], ids=["dev-zero", "fifo"])
def test_unusable_manifest_is_refused_at_once(tmp_path, monkeypatch, capsys, make):
    root = tmp_path / "ck"
    step = make_checkpoint(root, 2, names=TINY_NAMES, source="GPT")
    (step / "fxpipe.json").unlink()
    make(step / "fxpipe.json")
    within(60, refused, RUN + ["--checkpoint-dir", root, "--resume"], monkeypatch, capsys,
            "--resume: no intact checkpoint", "step_0000002/fxpipe.json is a")


@pytest.mark.parametrize("make, kind", [(lambda p: p.symlink_to("/dev/zero"), "character device"),
                                        (os.mkfifo, "FIFO")], ids=["dev-zero", "fifo"])
def test_costs_profile_that_is_not_a_file_is_refused_at_once(tmp_path, monkeypatch, capsys, make, kind):
    make(tmp_path / "profile.json")
    within(30, refused, RUN[:-2] + ["--costs", tmp_path / "profile.json"], monkeypatch, capsys,
            f"--costs {tmp_path}/profile.json", kind)


# ---- digests and ranges -----------------------------------------------------------
def test_tampered_schedule_falls_back_to_the_intact_step(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ck"
    for s in (2, 4):
        make_checkpoint(root, s, names=TINY_NAMES, source="GPT")
    edit_manifest(root / step_dirname(4), extra={"lr_scheduler": dict(schedule(4), base_lrs=[2e6])})
    from fxpipe.job.preflight_files import resume_path
    from fxpipe.job.config import TrainConfig
    assert resume_path(TrainConfig(checkpoint_dir=str(root), resume=True)) == root / step_dirname(2)
    assert launched(RUN + ["--checkpoint-dir", root, "--resume"], monkeypatch, capsys).resume


def test_tampered_only_step_is_refused_as_corrupt(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ck"
    make_checkpoint(root, 4, names=TINY_NAMES, source="GPT")
    edit_manifest(root / step_dirname(4), extra={"lr_scheduler": dict(schedule(4), base_lrs=[2e6])})
    refused(RUN + ["--checkpoint-dir", root, "--resume"], monkeypatch, capsys,
             "--resume: no intact checkpoint", "does not match its own SHA-256")


def test_resume_with_another_lr_is_refused_with_the_one_that_continues(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ck"
    make_checkpoint(root, 4, names=TINY_NAMES, source="GPT")
    refused(RUN + ["--checkpoint-dir", root, "--resume", "--lr", "1e-3"], monkeypatch, capsys,
             "base rate 0.002, this run's --lr is 0.001; resume with --lr 0.002")


@pytest.mark.parametrize("state, message", [
    ({}, "no 'lr_scheduler' state"),
    (dict(schedule(4), base_lrs=[]), "base_lrs must be 1 finite rates > 0"),
    (dict(schedule(4), base_lrs=[2e-3, 2e-3]), "base_lrs must be 1 finite rates > 0"),
    (dict(schedule(4), base_lrs=[-2e-3]), "base_lrs must be"),
    (dict(schedule(4), last_epoch=7), "last_epoch is 7, the checkpoint's step is 4"),
    (dict(schedule(4), last_epoch=True), "last_epoch is True"),
    (dict(schedule(4), _last_lr=[5.0]), "_last_lr must be 1 rates within [0, base rate]"),
])
def test_schedule_state_is_range_checked(state, message):
    extra = {"lr_scheduler": state} if state else {}
    with pytest.raises(ValueError, match=re.escape(message)):
        check_schedule(extra, 4, 2e-3, groups=1)


def test_an_intact_schedule_passes():
    check_schedule({"lr_scheduler": schedule(4)}, 4, 2e-3, groups=1)


# ---- weights ----------------------------------------------------------------------


def test_stale_index_beside_a_newer_file_is_refused_naming_both(tmp_path, monkeypatch, capsys):
    d = hf_weights(tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}))
    old = (d / "model.safetensors").stat().st_mtime - 3600
    os.utime(d / "model.safetensors.index.json", (old, old))
    refused(RUN + ["--init-from", d], monkeypatch, capsys, f"{d}/model.safetensors.index.json (written",
             f"does not describe {d}/model.safetensors (written", "one of them is stale")


@pytest.mark.parametrize("index, message", [
    ("[1, 2]", "must be a JSON object whose 'weight_map'"),
    ('{"weight_map": {"w": "../../etc/passwd.safetensors"}}', "file names in the same directory"),
    ("[" * 100_000, "is not readable JSON (RecursionError)"),
])
def test_malformed_index_is_one_line(tmp_path, monkeypatch, capsys, index, message):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(index)
    refused(RUN + ["--init-from", d], monkeypatch, capsys, "--init-from", message)


def test_malformed_safetensors_header_is_one_line(tmp_path, monkeypatch, capsys):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    refused(RUN + ["--init-from", d], monkeypatch, capsys, f"--init-from: {d}: a safetensors file is malformed")


@pytest.mark.parametrize("tensor, message", [
    (torch.zeros(64, dtype=torch.int64), "transformer.ln_f.weight: file dtype I64 vs model float32"),
    (torch.zeros(64, dtype=torch.bool), "transformer.ln_f.weight: file dtype BOOL vs model float32"),
    (torch.zeros(64, dtype=torch.float64), "transformer.ln_f.weight: file dtype F64 vs model float32"),
    (torch.zeros(65), "transformer.ln_f.weight: file (65,) vs model (64,)"),
])
def test_weights_that_are_not_what_they_claim_are_refused_before_workers(tmp_path, monkeypatch, capsys,
                                                                        tensor, message):
    d = hf_weights(tmp_path, **{"transformer.ln_f.weight": tensor})
    refused(RUN + ["--init-from", d], monkeypatch, capsys, f"--init-from: weights {d} do not match", message)


def test_float_widening_is_accepted(tmp_path, monkeypatch, capsys):
    d = hf_weights(tmp_path, **{"transformer.ln_f.weight": torch.ones(64, dtype=torch.bfloat16)})
    assert launched(RUN + ["--init-from", d], monkeypatch, capsys).init_from == str(d)


def test_a_shard_linked_out_of_the_directory_is_refused(tmp_path):
    from fxpipe.params.hf_weights import WeightsDir

    d = hf_weights(tmp_path)
    outside = tmp_path / "outside.safetensors"
    (d / "model.safetensors").rename(outside)
    (d / "model.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match=f"model.safetensors leads outside {d}"):
        WeightsDir(d)
    # The hub cache's layout: snapshots/<rev>/model.safetensors -> ../../blobs/<sha>
    snap = tmp_path / "models--x" / "snapshots" / "abc"
    (tmp_path / "models--x" / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    blob = tmp_path / "models--x" / "blobs" / "0123"
    outside.rename(blob)
    (snap / "model.safetensors").symlink_to(Path("../../blobs/0123"))
    assert "transformer.wte.weight" in WeightsDir(snap).shapes


def test_export_removes_the_weights_it_replaces(tmp_path):
    from fxpipe.checkpoint.export import export_consolidated
    from fxpipe.params.hf_weights import WeightsDir

    ckpt = tmp_path / "ck"
    make_checkpoint(ckpt, 1, names=("w", "v"))
    out = tmp_path / "hf"
    export_consolidated(ckpt, out, max_shard_bytes=8)  # two shards and an index
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors",
                                                    "model.safetensors.index.json"]
    export_consolidated(ckpt, out)  # one file: the index and the shards it replaces are gone
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert set(WeightsDir(out).shapes) == {"w", "v"}
    export_consolidated(ckpt, out, max_shard_bytes=8)  # and back
    assert "model.safetensors" not in {p.name for p in out.iterdir()}
    assert set(WeightsDir(out).shapes) == {"w", "v"}


def test_vocabulary_smaller_than_the_data_is_refused(monkeypatch, capsys):
    refused(RUN + ["--model", "hf:llama"], monkeypatch, capsys,
             "hf:llama has a vocabulary of 128 tokens", "the tokenizer of the Python standard library's source has 256: its largest id is 255", "at least 256")
    w = build_workload("hf:llama", batch=1, seq=4)
    with pytest.raises(ValueError, match="token id 255 is outside the model's vocabulary of 128"):
        w.batch_from_tokens(torch.full((1, 5), 255))


# ---- 6. before workers: user code, sizes, writability ------------------------------------------------
@pytest.mark.parametrize("extra, expected", [
    (["--model", "tests.job._bad_models:raises"], ["--model tests.job._bad_models:raises raised ZeroDivisionError: integer division or modulo by zero"]),
    (["--model", "tests.job._bad_models:garbage_batch"], ["the batch must be a tensor", "(str)"]),
    (["--seed", str(2**70)], ["--seed must be in [0, 2**63)", str(2**70)]),
    (["--pp", "512"], ["tp·pp·dp = 512 worker processes", "at most", "torchrun"]),
    (["--microbatches", "1000000", "--pp", "2"], ["2000000 stage-microbatch pairs", "at most 100000"]),
])
def test_refused_before_workers(extra, expected, monkeypatch, capsys):
    refused(RUN + extra, monkeypatch, capsys, *expected)


def test_global_batch_hints_only_values_that_satisfy_it():
    """Every hint, applied, gives b·m·dp = the global batch (brute force over a grid)."""
    for gb in range(1, 41):
        for b in range(1, 7):
            for dp in range(1, 5):
                hint = _batch_hint(gb, b, dp)
                if "multiple of --dp" in hint:
                    assert gb % dp
                    continue
                flags = dict(re.findall(r"--([a-z-]+) (\d+)", hint))
                b2, m2 = int(flags.get("micro-batch-size", b)), int(flags["microbatches"])
                assert b2 * m2 * dp == gb and b2 >= 1 and m2 >= 1, (gb, b, dp, hint)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_writability_is_a_real_write(tmp_path, monkeypatch, capsys, code):
    """os.access says yes to root on a full or read-only disk; the probe's write says why."""
    def fsync(fd):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(fxpipe.job.preflight_files.os, "fsync", fsync)
    refused(RUN + ["--checkpoint-dir", tmp_path / "ck"], monkeypatch, capsys,
             f"--checkpoint-dir {tmp_path}/ck cannot be written (tried a file in {tmp_path})",
             f"{errno.errorcode[code]}: {os.strerror(code)}")
    assert not list(tmp_path.glob(".fxpipe-probe-*")), "the probe file is removed"


@pytest.mark.parametrize("argv, expected", [
    (["viz", "--schedule", "1f1b", "--pp", "100000", "--microbatches", "100000"],
     "10000000000 stage-microbatch pairs; fxpipe draws a schedule of at most 100000"),
    (["viz", "--schedule", "1f1b", "--pp", "64", "--microbatches", "512", "-o", "x.png"],
     "fxpipe draws an image of at most 20000"),
    (["plan", "--model", "gpt3-175b", "--gpus", "8", "--global-batch", "10000000"],
     "--global-batch must be in [1, 65536], got 10000000"),
])
def test_viz_and_plan_refuse_what_would_not_fit(argv, expected, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err


# ---- the preflight never tracebacks ----------------------------------------------
def test_gpt2_medium_passes_the_preflight_on_meta(monkeypatch, capsys):
    """`fxpipe run --model gpt2-medium` captured on meta in the launcher (was: .max() of a meta tensor)."""
    config = launched(["run", "--model", "gpt2-medium", "--steps", "2", "--seq", "64", "--micro-batch-size", "1",
                        "--microbatches", "4", "--costs", "model", "--timeline", "none"], monkeypatch, capsys)
    assert config.model == "gpt2-medium" and fxpipe.models.registry.build_device("gpt2-medium") == "meta"


def test_every_registry_model_passes_or_is_refused_in_one_line(monkeypatch):
    """Every name through ``check_run`` with 1 layer (each name's widths, heads and
    vocabulary; the large ones still on meta): the check passes or says why in one line."""
    import dataclasses

    import fxpipe.job.preflight as preflight
    from fxpipe.ir.parallel_config import ParallelConfig
    from fxpipe.models import registry
    from fxpipe.job.config import TrainConfig

    devices = {n: registry.build_device(n) for n in registry.model_names()}
    for name, cfg in list(registry.GPT_CONFIGS.items()):
        monkeypatch.setitem(registry.GPT_CONFIGS, name, dataclasses.replace(cfg, n_layer=1))
    import fxpipe.job.prepare as prepare

    monkeypatch.setattr(preflight, "build_device", devices.__getitem__)
    monkeypatch.setattr(prepare, "build_device", devices.__getitem__)
    outcomes = {}
    for name in registry.model_names():
        config = TrainConfig(model=name, parallel=ParallelConfig(tp=1, pp=1, dp=1, microbatches=1, costs="model"),
                             micro_batch_size=1, seq=8, steps=1, timeline=None)
        try:
            preflight.check_run(config)
            outcomes[name] = "ok"
        except preflight.PreflightError as exc:
            assert "\n" not in str(exc)
            outcomes[name] = str(exc)
    assert "meta" in devices.values()
    # A 1-layer gpt3-175b still holds a 12288-wide embedding: ~2.5e9 parameters, whose fp32
    # training state (16 B each) is refused on a machine with less memory free than that.
    # (refused from the config's sizes, job/preflight_sizes.py, or after the capture, check_state_fits)
    assert all(v == "ok" or ("training state" in v and "(16 bytes each" in v)
               for n, v in outcomes.items() if not n.startswith("hf:")), outcomes
    assert all(outcomes[n] == "ok" for n in ("gpt-tiny", "gpt-nano", "gpt-small", "gpt2-small")), outcomes
    assert all("vocabulary of 128" in v for n, v in outcomes.items() if n.startswith("hf:")), outcomes


def test_a_rank_without_an_error_report_is_summarised_by_its_exit_code():
    """A worker that could not write its error file (ENOSPC) used to be summarised by
    torch's "To enable traceback see ..." line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    exc = ChildFailedError("_spawned_entry", {1: ProcessFailure(local_rank=1, pid=9, exitcode=1,
                                                                 error_file="/nonexistent/error.json")})
    line = fxpipe.job.launcher.summarize_failure(exc)
    assert line.startswith("rank 1 failed: exit code 1, and no error report") and "ENOSPC" in line, line
    assert "To enable traceback" not in line
