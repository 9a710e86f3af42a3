"""compile's and run's flags are generated from the config dataclasses: every field has
exactly one flag, the flags both commands share are the same argument, the defaults
shown are the dataclasses' values; --config TOML uses the same keys."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from fxpipe.cli import build_parser
from fxpipe.cli.compile import DEFAULT_LAYOUT, SKIPPED, CompileTarget
from fxpipe.job.flags import LAYOUT_FLAGS, TARGET_FLAGS, TRAIN_FLAGS
from fxpipe.cli.run import DEFAULT, resolve
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.job.config_file import read_config, to_toml
from fxpipe.job.config import TrainConfig


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices[name]


def _by_dest(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions if a.option_strings}


def test_every_field_has_one_flag():
    assert set(LAYOUT_FLAGS) == {f.name for f in dataclasses.fields(ParallelConfig)}
    assert set(TRAIN_FLAGS) == {f.name for f in dataclasses.fields(TrainConfig)} - {"parallel"}
    assert set(TARGET_FLAGS) | {"model", "seq"} == {f.name for f in dataclasses.fields(CompileTarget)}
    for p in (_subparser("compile"), _subparser("run")):
        options = [o for a in p._actions for o in a.option_strings]
        assert len(options) == len(set(options)), "a flag defined twice"


def test_compile_and_run_share_one_definition_per_flag():
    compile_, run = _by_dest(_subparser("compile")), _by_dest(_subparser("run"))
    # --world: both search the layout of N ranks, but their defaults differ (compile compiles
    # the layout given unless --world is; run searches when no layout flag is given).
    shared = set(compile_) & set(run) - {"help", "debug", "world"}
    assert shared == (set(LAYOUT_FLAGS) - SKIPPED) | {"model", "seq"}
    for dest in shared:
        a, b = compile_[dest], run[dest]
        same = ("option_strings", "type", "choices", "metavar", "nargs", "const")
        assert [getattr(a, k) for k in same] == [getattr(b, k) for k in same], dest
        # The help text is one; only the "(default: X)" tail is each command's dataclass value.
        assert a.help.split(" (default: ")[0] == b.help.split(" (default: ")[0], dest
    # --costs: one default (the library's own) for both commands.
    assert DEFAULT_LAYOUT.costs == DEFAULT.parallel.costs == ParallelConfig().costs == "measure"
    assert compile_["costs"].help.endswith("(default: measure)") and run["costs"].help.endswith("(default: measure)")


def test_defaults_shown_are_the_dataclass_values():
    run = _by_dest(_subparser("run"))
    assert run["lr"].help.endswith(f"(default: {DEFAULT.lr})")
    assert run["tp"].help.endswith(f"(default: {DEFAULT.parallel.tp})")
    assert run["num_microbatches"].help.endswith(f"(default: {DEFAULT.parallel.num_microbatches})")
    compile_ = _by_dest(_subparser("compile"))
    assert compile_["num_microbatches"].help.endswith(f"(default: {DEFAULT_LAYOUT.num_microbatches})")
    assert compile_["model"].help.endswith(f"(default: {CompileTarget().model})")
    # Flags not given are absent, so they override nothing (neither the file nor the dataclass).
    assert resolve(build_parser().parse_args(["run"])) == DEFAULT


def test_run_help_lists_every_flag_once(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    out = capsys.readouterr().out
    for flag in [*TRAIN_FLAGS.values(), *LAYOUT_FLAGS.values()]:
        option = f"--no-{flag.key}" if flag.kind.value == "negated" else flag.option
        lines = [l for l in out.splitlines() if l.startswith("  --") and l.split()[0] == option]
        assert len(lines) == 1, option


def test_config_file_keys_are_the_flags_and_flags_override_it(tmp_path):
    (tmp_path / "run.toml").write_text('model = "gpt-tiny"\nseq = 32\nlr-schedule = "cosine"\ngrad-clip = 1.0\n'
                                       'tp = 1\npp = 2\nsp = false\n[x]\n')
    with pytest.raises(ValueError, match=r"unknown key 'x'; valid keys: .*grad-clip.*lr-schedule"):
        read_config(str(tmp_path / "run.toml"), {**TRAIN_FLAGS, **LAYOUT_FLAGS})
    (tmp_path / "run.toml").write_text('[run]\nmodel = "gpt-tiny"\nseq = 32\nlr-schedule = "cosine"\n'
                                       'grad-clip = 1.0\ntp = 1\npp = 2\n')
    config = resolve(build_parser().parse_args(["run", "--config", str(tmp_path / "run.toml"), "--pp", "1"]))
    assert (config.model, config.seq, config.grad_clip, config.parallel.tp) == ("gpt-tiny", 32, 1.0, 1)
    assert config.lr_schedule.value == "cosine" and config.parallel.pp == 1, "the flag wins over the file"
    for bad, message in (("seq = 0", "seq: must be >= 1, got 0"), ('tp = "2"', "tp must be a number"),
                         ("sp = 1", "sp must be true or false"), ('precision = "fp8"', "precision must be one of")):
        (tmp_path / "bad.toml").write_text(bad + "\n")
        with pytest.raises(ValueError, match=message):
            read_config(str(tmp_path / "bad.toml"), {**TRAIN_FLAGS, **LAYOUT_FLAGS})


def test_saved_config_runs_again(tmp_path):
    """The TOML saved beside checkpoints resolves to the same config."""
    config = resolve(build_parser().parse_args(
        ["run", "--model", "gpt-tiny", "--seq", "32", "--schedule", "interleaved", "--pp", "2", "--microbatches",
         "4", "--eval-interval", "5", "--timeline", "none", "--grad-clip", "0.5", "--no-scatter-gather"]))
    (tmp_path / "saved.toml").write_text(to_toml(config))
    again = resolve(build_parser().parse_args(["run", "--config", str(tmp_path / "saved.toml")]))
    assert again == config


def test_saved_config_replays_the_run_not_the_launch():
    """The config saved beside checkpoints leaves out what described one launch: replayed
    after later saves, it must not resume from that launch's step again (nor overwrite)."""
    config = resolve(build_parser().parse_args(["run", "--checkpoint-dir", "ck", "--resume-from", "4",
                                                "--overwrite", "--steps", "9"]))
    assert config.resume_from == 4 and config.overwrite
    text = to_toml(config)
    assert "steps = 9" in text and "resume = true" in text
    assert "resume-from" not in text and "overwrite" not in text
