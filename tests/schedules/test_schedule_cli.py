"""``fxpipe viz`` through the two functions the main CLI wires in."""
import argparse

import pytest

from fxpipe.schedules import SCHEDULES
from fxpipe.cli.viz import add_viz_arguments, run_viz


def parse(*argv):
    parser = argparse.ArgumentParser(prog="fxpipe viz")
    add_viz_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_ascii_for_every_schedule(name, capsys):
    assert run_viz(parse("--schedule", name, "--pp", "4", "--microbatches", "8")) == 0
    out = capsys.readouterr().out
    assert out.startswith(name) and out.count("rank ") >= 4
    assert "bubble" in out and "peak in flight" in out


def test_outputs(tmp_path, capsys):
    for ext in ("png", "svg", "json"):
        path = tmp_path / f"s.{ext}"
        argv = ["--schedule", "interleaved", "--pp", "4", "--microbatches", "8", "--chunks", "2",
                "--durations", "1,2,1", "--p2p-latency", "0.1", "-o", str(path)]
        assert run_viz(parse(*argv)) == 0
        assert path.stat().st_size > 0
        assert f"wrote {path}" in capsys.readouterr().out


def test_user_errors(capsys):
    assert run_viz(parse("--schedule", "nope", "--pp", "4", "--microbatches", "8")) == 2
    assert "valid names are: gpipe, 1f1b" in capsys.readouterr().err
    assert run_viz(parse("--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--chunks", "2")) == 2
    assert "use 'interleaved'" in capsys.readouterr().err
    assert run_viz(parse("--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "-o", "x.txt")) == 2
    assert "unknown output type" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--durations", "1,2")
    assert "three numbers F,B,W" in capsys.readouterr().err


def test_vocab_passes_drawn_with_their_legend(tmp_path, capsys):
    argv = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--durations", "1.6,3.2,1.6",
            "--vocab-passes", "0.6,1.2"]
    assert run_viz(parse(*argv)) == 0
    out = capsys.readouterr().out
    assert "0S3" in out and "1T3" in out  # every rank runs its block of every microbatch
    path = tmp_path / "v.svg"
    assert run_viz(parse(*argv, "-o", str(path))) == 0
    svg = path.read_text()
    assert "vocabulary S" in svg and "vocabulary T" in svg
    assert run_viz(parse(*argv[:-1], "5,1")) == 2  # more than the last stage holds
    assert "must fit in the last stage" in capsys.readouterr().err
