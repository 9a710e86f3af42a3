"""The API's layout search refusing a pin (issue: trust, round four): each rank of a
2-rank world raises the same clear error — before, rank 0 said why and the others died
with gloo's "Connection closed by peer" — and ``fxpipe run`` says it with its flags'
names."""
from __future__ import annotations

import re

import pytest

import fxpipe.job.launcher
from fxpipe import cli
from fxpipe.job.flags import in_flag_words
from tests.runtime._dist import run_world
from tests.runtime._search_refusal_cases import ep_without_experts, tiny_memory_limit
from tests.job._cli import _spawned, refused

CLI = ["run", "--model", "gpt-tiny", "--world", "2", "--seq", "16", "--steps", "1", "--timeline", "none",
       "--costs", "model"]


@pytest.mark.slow
def test_ep_on_a_model_without_experts_is_refused_alike_on_every_rank():
    """Named by its cause; before, every candidate was dropped and the message blamed the
    batch and the world ("no layout of 2 ranks honours ep=2 ...")."""
    ranks = run_world(2, ep_without_experts)
    assert ranks[0] == ranks[1], ranks
    kind, message = ranks[0]
    assert kind == "ValueError", ranks
    assert message.startswith("ep=2 spreads the experts of grouped mixture-of-experts layers") and message.endswith(
        "over data-parallel ranks, but this model's graph has none; use ep=1"), message


@pytest.mark.slow
def test_a_memory_limit_nothing_fits_is_refused_alike_on_every_rank():
    ranks = run_world(2, tiny_memory_limit)
    assert ranks[0] == ranks[1], ranks
    kind, message = ranks[0]
    assert kind == "ValueError", ranks
    found = re.fullmatch(r"no layout of 2 ranks with no pinned field fits 1e-06 GiB per rank; the smallest needs "
                         r"(\S+) GiB: raise memory_limit_gb to (\S+), unpin a field, or use more ranks", message)
    assert found, message
    need, suggested = map(float, found.groups())
    # The limit as given (its bytes truncated read 9.993e-07), and a suggestion that fits the need.
    assert 1e-6 < need <= suggested < need * 1.001, (need, suggested)


def test_the_cli_refuses_ep_on_a_model_without_experts_in_flag_words(monkeypatch, capsys):
    err = refused(CLI + ["--ep", "2"], monkeypatch, capsys,
                   "--ep 2 spreads the experts of grouped mixture-of-experts layers", "this model's graph has none",
                   "use --ep 1")
    assert "ep=" not in err, err


@pytest.mark.slow
def test_the_cli_refuses_a_memory_limit_nothing_fits_in_flag_words(monkeypatch, capsys):
    """After the search's progress lines, one error line in flag words; no worker."""
    monkeypatch.setattr(fxpipe.job.launcher, "launch", _spawned)
    code = cli.main(CLI + ["--memory-limit", "1e-6", "--pp", "2", "--schedule", "1f1b"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    *progress, last = err.strip().splitlines()
    assert all(line.startswith("fxpipe: layout search: ") for line in progress), err
    assert last.startswith("fxpipe run: error: no layout of 2 ranks with --pp 2, --schedule 1f1b fits 1e-06 GiB per "
                           "rank; the smallest needs "), last
    assert "raise --memory-limit to " in last and "memory_limit_gb" not in last and "pp=" not in last, last


@pytest.mark.parametrize("flags, expected", [
    (["--ep", "2", "--tp", "1", "--pp", "1"], "--ep 2 does not divide --dp 1: the experts are owned by data-parallel "
                                             "ranks, choose --ep among [1]"),
    (["--ep", "2", "--tp", "2", "--pp", "1", "--dp", "2"],
     "--ep 2 with --tp 2 is not built yet: expert parallelism runs with --tp 1; use --ep 1 to combine --tp"),
    (["--ep", "2", "--tp", "1", "--pp", "1", "--dp", "2", "--inductor"],
     "--ep 2 with --inductor is not built yet: expert parallelism runs with no --inductor; use --ep 1"),
])
def test_the_cli_refuses_an_ep_layout_in_flag_words(monkeypatch, capsys, flags, expected):
    """A layout given whole is checked by the layout's own rules, worded with the flags."""
    refused(CLI[:3] + CLI[5:] + flags, monkeypatch, capsys, expected)


def test_api_messages_in_flag_words():
    assert in_flag_words("no layout of 4 ranks with tp=3, num_microbatches=4, schedule=1f1b, sp=True, "
                         "vocab_passes=False fits 1e-06 GiB per rank: raise memory_limit_gb to 0.001; dp must divide "
                         "the rows and tp·pp·dp equal the world") == (
        "no layout of 4 ranks with --tp 3, --microbatches 4, --schedule 1f1b, --sp, no --vocab-passes fits 1e-06 GiB "
        "per rank: raise --memory-limit to 0.001; dp must divide the rows and tp·pp·dp equal the world")


@pytest.mark.slow
def test_the_cli_searches_a_moe_with_ep_pinned(tmp_path, monkeypatch, capsys):
    """``--world 2 --ep 2`` is a pin for the search, not a layout checked against the
    defaults (before: "ep=2 with tp=2 is not built yet", tp=2 being no flag given)."""
    import numpy as np

    from tests.models._model_dirs import _mixtral_dir
    from tests.job._cli import launched

    model = _mixtral_dir(tmp_path / "mixtral")  # grouped experts, vocabulary 128
    np.random.default_rng(0).integers(0, 128, 20_000, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    argv = ["run", "--model", model, "--data", tmp_path / "ids.bin", "--world", "2", "--ep", "2", "--seq", "16",
            "--steps", "1", "--timeline", "none", "--costs", "model"]
    config = launched(argv, monkeypatch, capsys)
    layout = config.parallel
    assert (layout.ep, layout.tp, layout.tp * layout.pp * layout.dp) == (2, 1, 2), layout
    assert config.batch == 16, "the global batch of the defaults (b·m·dp), not of a stand-in dp"
