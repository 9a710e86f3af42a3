"""No code from a model or tokenizer directory runs: a directory whose config or tokenizer asks for
its own code (``auto_map``) is refused, naming the files it would run, before anything from it
is imported."""
from __future__ import annotations

import json

import pytest

from fxpipe.base.safe_io import UnsafeFileError, code_references

from tests.job._cli import RUN, refused
from tests.models._model_dirs import llama_config


EVIL = "import pathlib; pathlib.Path(__file__).with_name('RAN').write_text('code ran')\n"


def test_auto_map_names_the_files_it_would_run():
    assert code_references({"auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                                         "AutoModelForCausalLM": "other/repo--modeling_evil.EvilLM"}}) == [
        "configuration_evil.py", "modeling_evil.py"]
    assert code_references({"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTok", None]}}) == [
        "tokenization_evil.py"]
    assert code_references({"model_type": "llama"}) == []


@pytest.mark.parametrize("model_type", ["llama", "evil"])
def test_a_model_directory_that_wants_its_code_run_is_refused_before_anything_runs(
        tmp_path, monkeypatch, capsys, model_type):
    d = llama_config(tmp_path / "m", model_type=model_type,
                      auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (d / name).write_text(EVIL)
    argv = [a for a in RUN if a != "gpt-tiny"]
    argv.insert(argv.index("--model") + 1, str(d))
    refused(argv, monkeypatch, capsys, "asks to run custom code (configuration_evil.py, modeling_evil.py",
             "fxpipe never runs code")
    assert not (d / "RAN").exists()
    from fxpipe.models.hf_dir import load_config

    with pytest.raises(UnsafeFileError, match="configuration_evil.py"):
        load_config(str(d))
    assert not (d / "RAN").exists()


def test_a_tokenizer_directory_that_wants_its_code_run_is_refused(tmp_path):
    from fxpipe.data.tokenizer import load_tokenizer

    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    (d / "tokenization_evil.py").write_text(EVIL)
    with pytest.raises(UnsafeFileError, match=r"tokenizer_config.json asks to run custom code \(tokenization_evil.py"):
        load_tokenizer(d)
    assert not (d / "RAN").exists()
