"""Bad inputs, table-driven: each gives one clear message (asserted by its key numbers
and words), no traceback, exit code 2 — and for ``fxpipe run``, before any worker is
spawned (``fxpipe.job.launcher.launch`` is replaced by a function that fails the test).

Everything runs in this process: the CLI through ``fxpipe.cli.main``, the API in a
world of one process (``parallelize`` without torchrun's environment)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist

import fxpipe.job.launcher
from fxpipe import cli
from fxpipe.models import build_workload
from tests.checkpoint._ckpt_files import make_checkpoint

RUN = ["run", "--model", "gpt-tiny", "--seq", "16", "--tp", "1", "--pp", "2", "--steps", "2",
       "--timeline", "none", "--micro-batch-size", "2", "--microbatches", "2"]
COMPILE = ["compile", "--model", "gpt-tiny", "--seq", "16"]
VIZ = ["viz", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4"]


def _spawned(*args, **kwargs):
    raise AssertionError("a worker was spawned although the launcher could have refused the input")


# ---- set-ups for cases that need files -------------------------------------------------------
def _a_file(tmp: Path) -> None:
    (tmp / "afile").write_text("x")


def _garbage_profile(tmp: Path) -> None:
    (tmp / "profile.json").write_text('{"format": 1, "groups": [[NaN, 0, 0, 0]]}')


def _readonly(tmp: Path, monkeypatch) -> None:
    # The tests may run as root, for whom every directory is writable: the probe write's
    # file creation fails there as the kernel would fail it.
    import errno
    import os
    import tempfile
    (tmp / "ro").mkdir()
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if Path(dir).name == "ro":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(*args, dir=dir, **kwargs)
    monkeypatch.setattr(fxpipe.job.preflight_files.tempfile, "mkstemp", mkstemp)


def _other_model(tmp: Path) -> None:
    # gpt-nano's names: 4 layers where gpt-tiny has 2.
    names = tuple(f"transformer.h.{i}.ln_1.weight" for i in range(4)) + ("transformer.wte.weight",)
    make_checkpoint(tmp / "ck", 3, names=names, source="GPT")


def _garbage_meta(tmp: Path) -> None:
    (make_checkpoint(tmp / "ck", 3) / "fxpipe.json").write_text("{not json")


def _empty_ckpt(tmp: Path) -> None:
    (tmp / "ck").mkdir()


def _token_files(tmp: Path) -> None:
    import numpy as np
    np.arange(4000, dtype=np.uint16).__mod__(200).tofile(tmp / "ok.bin")
    (tmp / "empty.bin").write_bytes(b"")
    (tmp / "odd.bin").write_bytes(b"\0" * 4001)
    np.zeros(30, dtype=np.uint16).tofile(tmp / "short.bin")
    np.zeros(10, dtype=np.uint16).tofile(tmp / "tiny.bin")
    ids = np.arange(4000, dtype=np.uint16) % 200
    ids[1234] = 300  # past gpt-tiny's 256
    ids.tofile(tmp / "wide.bin")
    (tmp / "run.toml").write_text('model = "gpt-tiny"\nlearning-rate = 1e-3\n')


def _text_and_wide_tokenizer(tmp: Path) -> None:
    from tests.data._corpus import train_bpe, write_corpus
    train_bpe(tmp / "tok", write_corpus(tmp / "texts"), vocab_size=300)


def _datasets(tmp: Path) -> None:
    import datasets
    datasets.Dataset.from_dict({"body": ["a b c"] * 40, "n": list(range(40))}).save_to_disk(str(tmp / "nocol"))
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 40 + [[299, 300]]}).to_parquet(str(tmp / "ids.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp / "nosplit"))
    _text_and_wide_tokenizer(tmp)


def _not_a_causal_lm(tmp: Path) -> None:
    import transformers
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64).save_pretrained(tmp / "vit")


CASES = [
    # -- fxpipe run: data, tokenizer and model directory (before any worker)
    ("run-data-missing", RUN + ["--data", "{tmp}/nope.bin"], ["--data: no such file", "nope.bin"], None),
    ("run-data-empty", RUN + ["--data", "{tmp}/empty.bin"], ["empty.bin is empty (0 bytes)"], _token_files),
    ("run-data-dtype", RUN + ["--data", "{tmp}/odd.bin"],
     ["odd.bin is 4001 bytes, not a multiple of 2 (uint16)"], _token_files),
    ("run-data-short", RUN + ["--data", "{tmp}/short.bin"],
     ["short.bin holds 30 tokens: 1 training windows of --seq 16", "one global batch of 4 sequences"], _token_files),
    ("run-data-ids-over-vocab", RUN + ["--data", "{tmp}/wide.bin"],
     ["vocabulary of 256 tokens", "largest token id in", "wide.bin is 300", "at least 301"], _token_files),
    ("run-tokenizer-over-vocab", RUN + ["--data", "{tmp}/texts", "--tokenizer", "{tmp}/tok"],
     ["vocabulary of 256 tokens", "tokenizer of", "has 300", "at least 300"], _text_and_wide_tokenizer),
    ("run-dataset-no-column", RUN + ["--data", "{tmp}/nocol"],
     ["nocol has no column 'text' (its columns: body, n)", "--text-column"], _datasets),
    ("run-dataset-column-not-text", RUN + ["--data", "{tmp}/nocol", "--text-column", "n"],
     ["column 'n' holds int64, not text (string) or token ids"], _datasets),
    ("run-dataset-no-train-split", RUN + ["--data", "{tmp}/nosplit"],
     ["holds the splits test, no 'train'"], _datasets),
    ("run-dataset-ids-other-tokenizer", RUN + ["--data", "{tmp}/ids.parquet", "--tokenizer", "{tmp}/tok"],
     ["token id 300 is beyond the tokenizer's vocabulary of 300", "another tokenizer"], _datasets),
    ("prepare-data-no-column", ["prepare-data", "{tmp}/nocol", "--quiet"],
     ["nocol has no column 'text' (its columns: body, n)"], _datasets),
    ("run-model-dir-not-causal-lm", RUN + ["--model", "{tmp}/vit"],
     ["config.json is a 'vit' model (ViTConfig), not a causal language model"], _not_a_causal_lm),
    ("run-val-data-short", RUN + ["--data", "{tmp}/ok.bin", "--val-data", "{tmp}/tiny.bin"],
     ["--val-data", "tiny.bin holds 10 tokens, fewer than one window of --seq 16 + 1"], _token_files),
    ("run-metrics-file-missing-dir", RUN + ["--metrics-file", "{tmp}/nope/m.jsonl"],
     ["--metrics-file", "nope does not exist"], None),
    ("run-config-unknown-key", RUN + ["--config", "{tmp}/run.toml"],
     ["unknown key 'learning-rate'; valid keys:", "lr, lr-schedule"], _token_files),
    # -- fxpipe run: flags alone
    ("run-timeout-0", RUN + ["--timeout", "0"], ["--timeout must be a positive", "got 0.0"], None),
    ("run-timeout-negative", RUN + ["--timeout=-5"], ["--timeout", "got -5.0"], None),
    ("run-timeout-nan", RUN + ["--timeout", "nan"], ["--timeout", "got nan"], None),
    ("run-lr-nan", RUN + ["--lr", "nan"], ["--lr must be a positive finite number", "got nan"], None),
    ("run-lr-inf", RUN + ["--lr", "inf"], ["--lr", "got inf"], None),
    ("run-lr-0", RUN + ["--lr", "0"], ["--lr", "got 0.0"], None),
    ("run-lr-negative", RUN + ["--lr=-1e-3"], ["--lr", "got -0.001"], None),
    ("run-partition-unknown", RUN + ["--partition", "greedy"],
     ["unknown --partition 'greedy'", "ilp, uniform, params, dp"], None),
    ("run-schedule-unknown", RUN + ["--schedule", "pipedream"], ["unknown schedule 'pipedream'", "1f1b"], None),
    ("run-schedule-chunks", RUN + ["--schedule", "zb-v", "--chunks", "1"], ["zb-v", "num_chunks=2"], None),
    ("run-sp-without-tp", RUN + ["--sp"], ["--sp needs --tp > 1"], None),
    ("run-sp-seq", RUN + ["--sp", "--tp", "2", "--seq", "15"], ["--seq 15", "multiple of 2", "--seq 14"], None),
    ("run-seq-over-block", RUN + ["--seq", "100"], ["--seq 100", "block size 64"], None),
    ("run-global-batch", RUN + ["--global-batch", "7"],
     ["global batch 7", "2·2·1 = 4", "--micro-batch-size 1 --microbatches 7"], None),
    ("run-steps-0", RUN + ["--steps", "0"], ["argument --steps: must be >= 1, got 0"], None),
    ("run-pp-0", RUN + ["--pp", "0"], ["argument --pp: must be >= 1, got 0"], None),  # as compile: one flag
    ("run-micro-batch-0", RUN + ["--micro-batch-size", "0"], ["argument --micro-batch-size: must be >= 1"], None),
    ("run-save-interval-no-dir", RUN + ["--save-interval", "2"], ["need --checkpoint-dir"], None),
    ("run-save-interval-0", RUN + ["--save-interval", "0", "--checkpoint-dir", "{tmp}/ck"],
     ["argument --save-interval: must be >= 1, got 0"], None),
    # -- fxpipe run: the file system
    ("run-ckpt-dir-is-file", RUN + ["--checkpoint-dir", "{tmp}/afile"], ["--checkpoint-dir", "afile is a file"], _a_file),
    ("run-ckpt-dir-under-file", RUN + ["--checkpoint-dir", "{tmp}/afile/sub"],
     ["cannot be created", "afile is a file"], _a_file),
    ("run-ckpt-dir-readonly", RUN + ["--checkpoint-dir", "{tmp}/ro"],
     ["--checkpoint-dir", "ro cannot be written: EACCES: Permission denied"], _readonly),
    ("run-ckpt-dir-readonly-parent", RUN + ["--checkpoint-dir", "{tmp}/ro/new"],
     ["ro/new cannot be written (tried a file in", "EACCES"], _readonly),
    ("run-export-missing-dir", RUN + ["--export", "{tmp}/nope/model.pt"], ["--export", "nope does not exist"], None),
    ("run-export-dir-under-file", RUN + ["--export", "{tmp}/afile/hf"], ["--export", "afile is a file"], _a_file),
    ("run-export-readonly", RUN + ["--export", "{tmp}/ro/model.pt"], ["--export", "cannot be written", "EACCES"],
     _readonly),
    ("run-timeline-missing-dir", RUN + ["--timeline", "{tmp}/nope/t"], ["--timeline", "nope does not exist"], None),
    ("run-resume-empty", RUN + ["--checkpoint-dir", "{tmp}/ck", "--resume"],
     ["--resume: no complete checkpoint", "start without --resume"], _empty_ckpt),
    ("run-costs-typo", RUN + ["--costs", "mesure"],
     ["--costs mesure", "not a readable cost profile", "--costs measure"], None),
    ("run-costs-garbage-profile", RUN + ["--costs", "{tmp}/profile.json"],
     ["--costs", "non-finite number NaN", "--costs model"], _garbage_profile),
    # -- fxpipe run: the model (captured once in the launcher)
    ("run-model-unknown", RUN + ["--model", "gpt-huge"], ["unknown model 'gpt-huge'", "gpt-tiny", "hf:gpt2"], None),
    ("run-model-hf-unknown", RUN + ["--model", "hf:bert"], ["unknown Hugging Face family 'bert'", "hf:llama"], None),
    ("run-model-module-missing", RUN + ["--model", "no_such_pkg.models:build"],
     ["cannot load model function 'no_such_pkg.models:build'", "No module named"], None),
    ("run-model-function-missing", RUN + ["--model", "tests.job._bad_models:nope"],
     ["cannot load model function 'tests.job._bad_models:nope'", "has no attribute 'nope'"], None),
    ("run-model-returns-module", RUN + ["--model", "tests.job._bad_models:not_a_tuple"],
     ["must return (model, batch)", "got Linear"], None),
    ("run-tp-vs-heads", RUN + ["--tp", "3"], ["4 attention heads", "tp=3", "[1, 2, 4]"], None),
    ("run-tp-8-vs-4-heads", RUN + ["--tp", "8", "--pp", "1"], ["4 attention heads", "tp=8"], None),
    ("run-vocab-too-small", RUN + ["--model", "tests.job._bad_models:vocab100"],
     ["vocabulary of 100", "largest id is 255", "at least 256"], None),
    ("run-uniform-more-stages-than-layers", RUN + ["--partition", "uniform", "--pp", "4"],
     ["--partition uniform", "2 layers, 4 stages"], None),
    ("run-resume-other-model", RUN + ["--checkpoint-dir", "{tmp}/ck", "--resume"],
     ["saved from another model", "(GPT, 5 tensors)", "transformer.h.3.ln_1.weight", "--model that saved it"],
     _other_model),
    ("run-resume-garbage-meta", RUN + ["--checkpoint-dir", "{tmp}/ck", "--resume"],
     ["--resume: no intact checkpoint", "fxpipe.json is not readable JSON"], _garbage_meta),
    # -- fxpipe compile
    ("compile-pp-0", COMPILE + ["--pp", "0"], ["argument --pp: must be >= 1, got 0"], None),
    ("compile-batch-0", COMPILE + ["--batch", "0"], ["argument --batch: must be >= 1, got 0"], None),
    ("compile-seq-0", COMPILE + ["--seq", "0"], ["argument --seq: must be >= 1, got 0"], None),
    ("compile-microbatches-0", COMPILE + ["--microbatches", "0"], ["argument --microbatches: must be >= 1"], None),
    ("compile-pp-text", COMPILE + ["--pp", "two"], ["argument --pp: expected an integer >= 1, got 'two'"], None),
    ("compile-memory-limit-0", COMPILE + ["--memory-limit", "0"], ["argument --memory-limit", "> 0, got 0"], None),
    ("compile-time-limit-nan", COMPILE + ["--time-limit", "nan"], ["argument --time-limit", "got nan"], None),
    ("compile-partition-unknown", COMPILE + ["--pp", "2", "--partition", "greedy"],
     ["unknown partition method 'greedy'", "ilp, uniform, params, dp"], None),
    ("compile-uniform-over-limit", COMPILE + ["--pp", "2", "--partition", "uniform", "--memory-limit", "0.0001"],
     ["'uniform' gives a plan over the memory limit of 0.0001 GiB", "rank 0: 0.00", "'ilp' honours the limit",
      "--allow-over-limit"], None),
    ("compile-params-over-limit", COMPILE + ["--pp", "2", "--partition", "params", "--memory-limit", "0.0001"],
     ["'params' gives a plan over the memory limit", "stage 1:", "GiB activations"], None),
    ("compile-ilp-infeasible-limit", COMPILE + ["--pp", "2", "--memory-limit", "0.0001"],
     ["memory limit 0.0001 GiB (107374 B)", "smallest limit that fits is", "GiB"], None),
    ("compile-tp-vs-heads", COMPILE + ["--tp", "3"], ["tp=3", "[1, 2, 4]"], None),
    ("compile-capture-error", ["compile", "--model", "tests.job._bad_models:data_dependent"],
     ["could not capture _Branchy", "branches on a tensor's value"], None),
    ("compile-skip-unknown-pass", COMPILE + ["--skip-pass", "fuse"], ["cannot skip unknown pass(es) ['fuse']"], None),
    # -- fxpipe viz / plan
    ("viz-output-missing-dir", VIZ + ["-o", "{tmp}/nope/s.png"], ["No such file or directory", "nope/s.png"], None),
    ("viz-output-type", VIZ + ["-o", "{tmp}/s.txt"], ["unknown output type '.txt'"], None),
    ("viz-microbatches-0", ["viz", "--schedule", "1f1b", "--pp", "2", "--microbatches", "0"],
     ["num_microbatches must be >= 1"], None),
    ("plan-model-unknown", ["plan", "--model", "nope", "--gpus", "8", "--global-batch", "8"],
     ["unknown model 'nope'", "gpt3-175b"], None),
]


@pytest.mark.parametrize("argv, expected, setup", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cli_refuses(argv, expected, setup, tmp_path, monkeypatch, capsys):
    import fxpipe.job.preflight_files  # noqa: F401  (the set-ups patch it)

    monkeypatch.setattr(fxpipe.job.launcher, "launch", _spawned)
    if setup is not None:
        setup(*(tmp_path, monkeypatch)[:setup.__code__.co_argcount])
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    # One message (argparse prints its usage first; a CaptureError has three short lines).
    assert "Traceback" not in err and f"fxpipe {argv[0]}: error: " in err, err
    assert len(err.split(": error: ", 1)[1].strip().splitlines()) <= 3, err
    for word in expected:
        assert word in err, f"{word!r} not in: {err}"


def test_cli_debug_shows_the_traceback(monkeypatch):
    from fxpipe.compiler.capture import CaptureError

    with pytest.raises(CaptureError, match="could not capture _Branchy"):
        cli.main(["compile", "--model", "tests.job._bad_models:data_dependent", "--debug"])
    with pytest.raises(FileNotFoundError):
        cli.main(VIZ + ["-o", "/nonexistent-dir/s.png", "--debug"])


def test_allow_over_limit_prints_the_plan(capsys):
    assert cli.main(COMPILE + ["--pp", "2", "--partition", "uniform", "--memory-limit", "0.0001",
                               "--allow-over-limit"]) == 0
    assert "limit" in capsys.readouterr().out


@pytest.mark.parametrize("command", [None, "compile", "run", "viz", "plan", "calibrate", "prepare-data"])
def test_help_of_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(([command] if command else []) + ["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fxpipe") and "--debug" in (out if command else "--debug")


def test_every_subcommand_is_covered_by_the_help_test():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == {"compile", "run", "viz", "plan", "calibrate", "prepare-data"}


# ---- the API: parallelize and train_step in a world of one process ---------------------------
@pytest.fixture
def world_of_one(monkeypatch):
    """``parallelize`` makes a world of one from these (restored afterwards, so processes
    that later tests start do not inherit them)."""
    from tests.runtime._dist import _free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _tiny():
    return build_workload("gpt-tiny", batch=4, seq=16)


API_CASES = [
    ("tp-over-world", dict(tp=2), ["world size 1"]),
    ("microbatches-0", dict(microbatches=0), ["microbatches must be >= 1, got 0"]),
    ("rows-not-divisible", dict(microbatches=3), ["batch of 4 rows", "dp·microbatches = 1·3"]),
    ("schedule-unknown", dict(schedule="pipedream"), ["unknown schedule 'pipedream'"]),
    ("partition-unknown", dict(partition="greedy"), ["unknown partition method 'greedy'", "ilp, uniform"]),
    ("precision-unknown", dict(precision="fp8"), ["fp8"]),
    ("recompute-unknown", dict(recompute="most"), ["most"]),
    ("costs-unknown", dict(costs="mesure"), ["costs must be 'measure', 'model' or the path", "'mesure' (no such file)"]),
    ("over-limit-uniform", dict(partition="uniform", memory_limit_gb=1e-5),
     ["'uniform' gives a plan over the memory limit of 1e-05 GiB", "'ilp' honours the limit"]),
    ("example-ids-over-vocab", dict(example_inputs="vocab"),
     ["token id 256", "vocabulary of 256", "ids 0..255", "embedding index"]),
]


@pytest.mark.parametrize("kwargs, expected", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_parallelize_refuses(kwargs, expected, world_of_one):
    from fxpipe.parallel import parallelize

    w = _tiny()
    args = dict(microbatches=2, example_inputs=w.example_inputs, partition="uniform", timeout_s=30)
    args.update(kwargs)
    if args["example_inputs"] == "vocab":
        x, y = w.example_inputs
        args["example_inputs"] = (x.clone().fill_(256), y)
    with pytest.raises((ValueError, TypeError)) as exc:
        parallelize(w.model, **args)
    for word in expected:
        assert word in str(exc.value), str(exc.value)


def test_train_step_checks_token_ids(world_of_one):
    """tp=1 would crash with an IndexError inside the embedding, vocabulary-parallel TP
    would read zeros; both get this error instead, before any compute."""
    from fxpipe.parallel import parallelize

    w = _tiny()
    pm = parallelize(w.model, microbatches=2, example_inputs=w.example_inputs, partition="uniform")
    roles = sorted((t.input_index, t.vocab_size, t.role.name) for t in pm.token_inputs)
    # Found from the graph: the ids feed the embedding (input 0), the targets the loss (input 1).
    assert roles == [(0, 256, "EMBEDDING"), (1, 256, "LOSS_TARGET")]
    x, y = w.example_inputs
    for bad, where, value in ((x.clone().fill_(300), 0, 300), (x.clone().fill_(-1), 0, -1),
                              (x, 1, 256)):
        batch = (bad, y) if where == 0 else (x, y.clone().fill_(256))
        with pytest.raises(ValueError, match=f"batch input {where} holds token id {value}"):
            pm.train_step(batch)
    with pytest.raises(TypeError, match="got 1 batch tensors"):
        pm.train_step((x,))
    loss = pm.train_step(w.example_inputs)  # and a good batch still trains
    assert math.isfinite(loss)


def test_token_inputs_of_a_hf_model():
    """Hugging Face's loss shifts labels with a pad of -100: the target bound is not traced
    through the pad, the embedding's is (a real vocabulary of 128)."""
    from fxpipe.compiler.capture import capture
    from fxpipe.ir.token_inputs import TokenRole, token_inputs

    w = build_workload("hf:llama", batch=2, seq=8)
    found = token_inputs(capture(w.model, w.example_inputs, w.loss_fn))
    assert (0, 128, TokenRole.EMBEDDING) in {(t.input_index, t.vocab_size, t.role) for t in found}


def test_failed_ranks_are_summarised_in_one_line(tmp_path):
    """The elastic launcher's ChildFailedError (per-rank error files as ``record`` writes
    them) becomes one line: the first rank to fail, its error, the others' numbers."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failure(rank: int, message: str, timestamp: int) -> ProcessFailure:
        path = tmp_path / f"error_{rank}.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "Traceback (most recent call last):\n  ...", "timestamp": str(timestamp)}}}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))

    exc = ChildFailedError("_spawned_entry", {
        0: failure(0, "PeerError: rank 0 receiving 'x' (microbatch 0) from rank 2: timed out", 20),
        2: failure(2, "RuntimeError: CUDA out of\nmemory", 10),
        3: ProcessFailure(local_rank=3, pid=103, exitcode=-15, error_file=str(tmp_path / "none"))})
    line = fxpipe.job.launcher.summarize_failure(exc)
    assert line == ("rank 2 failed: RuntimeError: CUDA out of memory (ranks 0, 3 failed too); "
                    "add --debug for every failed rank's traceback")
