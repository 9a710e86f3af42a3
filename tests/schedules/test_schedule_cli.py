"""``fxpipe viz`` through the two functions the main CLI wires in."""
import argparse

import pytest

from fxpipe.schedules import SCHEDULES
from fxpipe.schedules.cli import add_viz_arguments, run_viz


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
