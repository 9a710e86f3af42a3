from fxpipe.cli import main


def test_compile_prints_summary(capsys, tmp_path):
    graph = tmp_path / "g.txt"
    assert main(["compile", "--model", "gpt-tiny", "--graph", str(graph)]) == 0
    out = capsys.readouterr().out
    assert "GPT" in out and "layer 1" in out and "tied group" in out
    assert "aten.linear" in graph.read_text()


def test_compile_hf_llama(capsys):
    assert main(["compile", "--model", "hf:llama"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "2 repeated layers" in out


def test_unknown_model_is_a_user_error(capsys):
    assert main(["compile", "--model", "nope"]) == 2
    assert "valid names" in capsys.readouterr().err
