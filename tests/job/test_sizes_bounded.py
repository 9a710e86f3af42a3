"""Sizes bounded before work. A model's declared layers, width,
vocabulary and least parameter count are compared with what capture, search and this
machine can handle before any search, build or capture (``job/preflight_sizes.py``);
schedule generators refuse sizes they cannot build quickly; ``prepare-data --workers``
is capped like ``run``'s workers; a config.json's malformed size values are refused
naming the field and the value. Every case runs in this process, and must answer in
seconds: the refusals come from the config alone."""
from __future__ import annotations

import json

import pytest

import fxpipe.job.layout_choice
from fxpipe import cli
from tests.job._cli import RUN, refused


def _config_dir(path, **fields):
    """A Llama config.json as save_pretrained writes one, with ``fields`` replaced
    (no weights, nothing built)."""
    path.mkdir(parents=True, exist_ok=True)
    doc = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=32, intermediate_size=64,
               num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1, vocab_size=300,
               max_position_embeddings=64, rms_norm_eps=1e-6)
    doc.update(fields)
    (path / "config.json").write_text(json.dumps(doc))
    return path


def _with_model(d) -> list:
    argv = [a for a in RUN if a != "gpt-tiny"]
    argv.insert(argv.index("--model") + 1, str(d))
    return argv


def _searched(*args, **kwargs):
    raise AssertionError("a search, build or capture started although the size was refusable from the config")


@pytest.mark.parametrize("fields, expected", [
    (dict(num_hidden_layers=10_000), "declares 10,000 layers; fxpipe captures and searches models of at most 1,024"),
    (dict(hidden_size=2**20, intermediate_size=64), "declares 1,048,576 hidden width"),
    (dict(vocab_size=2**23), "declares 8,388,608 vocabulary"),
])
def test_a_config_too_large_to_capture_is_refused_at_once_by_run_and_plan(tmp_path, monkeypatch, capsys,
                                                                          fields, expected):
    import fxpipe.models.hf_dir
    import fxpipe.planner.captured

    d = _config_dir(tmp_path / "m", **fields)
    # Refused from the config alone: building or capturing the model fails the test.
    monkeypatch.setattr(fxpipe.models.hf_dir, "build_model", _searched)
    monkeypatch.setattr(fxpipe.planner.captured, "captured_shape", _searched)
    refused(_with_model(d), monkeypatch, capsys, expected, "use a smaller config")
    assert cli.main(["plan", "--model", str(d), "--gpus", "8", "--global-batch", "8"]) == 2
    assert expected in capsys.readouterr().err


def test_compile_refuses_a_million_layers_before_building(capsys):
    assert cli.main(["compile", "--model", "gpt-tiny", "--layers", "1000000"]) == 2
    assert "declares 1,000,000 layers" in capsys.readouterr().err


def test_a_model_whose_state_cannot_fit_is_refused_before_the_layout_search(tmp_path, monkeypatch, capsys):
    """81.6B parameters (Llama-70B's shape, 96 layers): no layout flag, so `run` would search;
    the least state (16 bytes per parameter) is refused from the config before the search."""
    d = _config_dir(tmp_path / "big", num_hidden_layers=96, hidden_size=8192, intermediate_size=28672,
                    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    monkeypatch.setattr(fxpipe.job.layout_choice, "choose_run_layout", _searched)
    least = 96 * (2 * 8192**2 + 2 * 8192 * 28672) + 128256 * 8192  # q and o, up and down, the embedding
    err = refused(["run", "--model", d, "--seq", "16", "--timeline", "none"], monkeypatch, capsys,
                   f"has at least {least:,} parameters", f"needs at least {least * 16 / 2**30:,.1f} GiB", "(96 layers, width 8192, vocabulary 128256)", "GiB (16 bytes each",
                   "use a smaller model, more ranks or more machines")
    assert "free on this machine" in err


def test_schedule_generators_refuse_sizes_they_cannot_build_quickly():
    from fxpipe.schedules.registry import MAX_PAIRS, generate

    for name in ("interleaved", "1f1b", "zb-v"):
        with pytest.raises(ValueError, match=r"--pp 1000 × --microbatches 1000 × \d chunk\(s\) = [\d]+ stage-microbatch "
                                             rf"pairs; fxpipe draws a schedule of at most {MAX_PAIRS}"):
            generate(name, 1000, 1000)


def test_prepare_data_workers_are_capped_like_runs(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("words " * 10)
    assert cli.main(["prepare-data", str(text), "--workers", "1000", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--workers must be in [1, " in err and "got 1000" in err and "CPU cores × 16" in err
    assert not list(tmp_path.glob(".a.txt.fxpipe-*")), "nothing tokenized"


@pytest.mark.parametrize("field, value, what", [
    ("hidden_size", -32, "not positive"), ("hidden_size", float("nan"), "not a number"),
    ("num_attention_heads", 0, "not positive"), ("num_hidden_layers", "2", "a string"),
    ("vocab_size", "512", "a string"), ("num_hidden_layers", True, "a boolean"), ("intermediate_size", 64.5, "not an integer"),
])
def test_malformed_config_values_are_refused_naming_the_field_and_value(tmp_path, monkeypatch, capsys, field, value, what):
    d = _config_dir(tmp_path / "m", **{field: value})
    refused(_with_model(d), monkeypatch, capsys, f"config.json: {field} is {value!r} ({what}); it must be a positive "
                                                  f"integer")
