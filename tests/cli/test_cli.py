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


def test_compile_prints_stage_table(capsys, tmp_path):
    import json

    out_json = tmp_path / "stages.json"
    assert main(["compile", "--model", "hf:gpt2", "--layers", "4", "--pp", "4", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "balance" in out and "optimality gap" in out
    rows = json.loads(out_json.read_text())["stages"]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["params"] for r in rows) > 0 and all(r["nodes"] > 0 for r in rows)


def test_compile_on_measured_costs(capsys, tmp_path, monkeypatch):
    """--costs measure times the graph here and prints the stage table on those times;
    the cached profile is then accepted as a path, and refused under another layout."""
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    assert main(["compile", "--model", "gpt-tiny", "--layers", "2", "--pp", "2", "--costs", "measure"]) == 0
    out = capsys.readouterr().out
    assert "times on 'measured: cpu:" in out
    (profile,) = (tmp_path / "costs").iterdir()
    assert main(["compile", "--model", "gpt-tiny", "--layers", "2", "--pp", "2", "--costs", str(profile)]) == 0
    assert main(["compile", "--model", "gpt-tiny", "--layers", "2", "--batch", "4", "--pp", "2",
                 "--costs", str(profile)]) == 2
    assert "another graph, batch shape or layout" in capsys.readouterr().err


def test_compile_infeasible_memory_limit_names_smallest_limit(capsys):
    assert main(["compile", "--model", "gpt-tiny", "--pp", "2", "--memory-limit", "0.000001"]) == 2
    err = capsys.readouterr().err
    assert "smallest limit that fits" in err and "binds" in err


def test_compile_tp_prints_sharding_report_and_scatter_gather_bytes(capsys):
    assert main(["compile", "--model", "hf:llama", "--tp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "sharded parameters" in out and "replicated parameters" in out
    assert "2 all-reduce | 2 all-reduce" in out  # Megatron: per layer, 2 forward, 2 backward
    line = next(l for l in out.splitlines() if l.startswith("inter-stage"))
    assert "(-50%" in line  # tp=2: each rank sends half of a replicated activation


def test_compile_heads_not_divisible_is_a_clear_error(capsys):
    assert main(["compile", "--model", "gpt-tiny", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "layer 0" in err and "4 attention heads" in err and "choose tp dividing 4" in err


def test_plan_is_wired(capsys):
    assert main(["plan", "--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s" in out and "searched" in out
