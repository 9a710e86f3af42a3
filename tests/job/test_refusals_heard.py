"""Every rank hears a refusal decided on rank 0; limits and messages
in the user's terms (CLI flag names, numbers that can be acted on)."""
from __future__ import annotations

import re

import pytest

import fxpipe.job.layout_choice
from fxpipe import cli
from fxpipe.ir.parallel_config import ParallelConfig
from tests.runtime._dist import run_world
from tests.runtime._refusal_cases import world_refusals


@pytest.mark.slow
def test_a_refusal_on_rank_0_is_raised_alike_on_every_rank():
    """Before, rank 0 said why and rank 1 died with gloo's "Connection closed by peer"."""
    ranks = run_world(2, world_refusals)
    assert ranks[0] == ranks[1], ranks
    (kind, first), (_, tp3), (_, pp8) = ranks[0]
    assert (kind, first) == ("ValueError", "rank 0 says no: 3 is not 2")
    assert "no layout of 2 ranks" in tp3 and "tp=3" in tp3, tp3
    assert "no layout of 2 ranks" in pp8 and "pp=8" in pp8, pp8


@pytest.mark.parametrize("limit", [float("inf"), 1e300, float("nan"), -1.0])
def test_a_memory_limit_out_of_range_is_refused_in_words(limit):
    with pytest.raises(ValueError, match=r"memory_limit_gb must be a number of GiB per rank in \(0, 1,048,576\], "
                                         rf"got {re.escape(str(limit))}; leave it out for no limit"):
        ParallelConfig(memory_limit_gb=limit)


def test_the_cli_refuses_a_memory_limit_of_1e300_naming_its_flag(monkeypatch, capsys):
    """(``inf`` is argparse's to refuse: "must be a finite number > 0".)"""
    from tests.job._cli import RUN, refused

    refused(RUN + ["--memory-limit", "1e300"], monkeypatch, capsys,
             "--memory-limit must be a number of GiB per rank in (0, 1,048,576], got 1e+300")


def test_the_searchs_refusal_names_the_cli_flag(monkeypatch, capsys):
    """The search (planner/auto_layout.py) words its refusal for the API; `fxpipe run` hands
    it to a CLI user with the flag's name."""
    def refuse(*args, **kwargs):
        raise ValueError("no layout of 2 ranks with no pinned field fits 0.00 GiB per rank; the smallest needs "
                         "0.01 GiB: raise memory_limit_gb to 0.01, unpin a field, or use more ranks")
    monkeypatch.setattr(fxpipe.job.layout_choice, "search_layout", refuse)
    monkeypatch.setattr(fxpipe.job.launcher, "launch", lambda *a, **k: pytest.fail("a worker was spawned"))
    code = cli.main(["run", "--model", "gpt-tiny", "--world", "2", "--seq", "16", "--steps", "1", "--timeline", "none",
                     "--costs", "model"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "raise --memory-limit to 0.01" in err and "memory_limit_gb" not in err, err


def test_memory_in_a_refusal_keeps_the_digits_to_act_on():
    """A tiny limit or need is not rounded to 0.00 GiB, and the limit suggested fits."""
    from fxpipe.planner.auto_layout import _gib

    assert _gib(1e-6 * 2**30) == "1e-06"
    assert _gib(0.0123451 * 2**30, up=True) == "0.01235" and _gib(0.0123451 * 2**30) == "0.01235"
    assert _gib(12.3401 * 2**30, up=True) == "12.35" and float(_gib(80 * 2**30, up=True)) == 80
