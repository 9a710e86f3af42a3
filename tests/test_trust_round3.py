"""Trust, round three: no code from a model or tokenizer directory, no output over a file
the run reads or through a link, nothing believed blindly. Each case goes through
``fxpipe.cli.main`` in this process with the launcher replaced by a function that fails
the test (``tests/test_preflight_trust.py``'s ``_refused``), or calls the API directly,
and asserts the message, the exit code and what stayed on disk."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxpipe.base.safe_io import UnsafeFileError, code_references
from tests.test_preflight_trust import RUN, _refused

EVIL = "import pathlib; pathlib.Path(__file__).with_name('RAN').write_text('code ran')\n"


def _llama_config(path: Path, **extra) -> Path:
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                             intermediate_size=64, vocab_size=300, max_position_embeddings=64).save_pretrained(path)
    doc = json.loads((path / "config.json").read_text())
    doc.update(extra)
    (path / "config.json").write_text(json.dumps(doc))
    return path


# ---- 1. no remote code ---------------------------------------------------------------------------
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
    d = _llama_config(tmp_path / "m", model_type=model_type,
                      auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (d / name).write_text(EVIL)
    argv = [a for a in RUN if a != "gpt-tiny"]
    argv.insert(argv.index("--model") + 1, str(d))
    _refused(argv, monkeypatch, capsys, "asks to run custom code (configuration_evil.py, modeling_evil.py",
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


# ---- 2. outputs never land on inputs or through links --------------------------------------------
def _corpus(tmp_path: Path) -> Path:
    from tests.data._corpus import write_corpus

    write_corpus(tmp_path / "texts", docs=20, words=200)
    return tmp_path / "texts"


@pytest.mark.parametrize("output", ["--metrics-file", "--export"])
def test_an_output_on_the_data_file_is_refused_and_the_data_kept(tmp_path, monkeypatch, capsys, output):
    data = _corpus(tmp_path) / "a.txt"
    before = data.read_bytes()
    _refused(RUN + ["--data", data, output, data], monkeypatch, capsys,
             f"{output} {data} is what --data reads", "choose another path")
    assert data.read_bytes() == before


def test_an_output_inside_the_data_directory_is_refused(tmp_path, monkeypatch, capsys):
    texts = _corpus(tmp_path)
    _refused(RUN + ["--data", texts, "--metrics-file", texts / "m.jsonl"], monkeypatch, capsys,
             f"--metrics-file {texts}/m.jsonl lies inside {texts}, the directory --data reads")
    assert not (texts / "m.jsonl").exists()


def test_export_into_the_init_from_directory_is_refused_and_the_weights_kept(tmp_path, monkeypatch, capsys):
    from tests.test_preflight_trust import _weights

    d = _weights(tmp_path)
    before = (d / "model.safetensors").read_bytes()
    _refused(RUN + ["--init-from", d, "--export", d], monkeypatch, capsys, f"--export {d} is what --init-from reads")
    assert (d / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("flag, suffix", [("--metrics-file", ""), ("--timeline", ".json")])
def test_an_output_that_is_a_link_is_refused_and_its_target_kept(tmp_path, monkeypatch, capsys, flag, suffix):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / f"out{suffix}").symlink_to(victim)
    _refused(RUN + [flag, tmp_path / "out"], monkeypatch, capsys, f"{tmp_path}/out{suffix} is a symbolic link",
             "writes no output through a link")
    assert victim.read_text() == "precious\n"


def test_two_outputs_on_one_path_are_refused(tmp_path, monkeypatch, capsys):
    _refused(RUN + ["--metrics-file", tmp_path / "x.json", "--timeline", tmp_path / "x"], monkeypatch, capsys,
             "is also where --metrics-file writes")


def test_the_writers_do_not_follow_a_link_made_after_the_check(tmp_path):
    from fxpipe.base.safe_io import open_output
    from fxpipe.job.components import MetricsWriter

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "m.jsonl").symlink_to(victim)
    with pytest.raises(UnsafeFileError, match="m.jsonl is a symbolic link"):
        MetricsWriter(str(tmp_path / "m.jsonl"), None)
    with pytest.raises(UnsafeFileError, match="is a FIFO"):
        import os
        os.mkfifo(tmp_path / "fifo")
        open_output(tmp_path / "fifo")
    assert victim.read_text() == "precious\n"
    with open_output(tmp_path / "new.txt") as f:  # a plain file is written, and truncated when rewritten
        f.write("a long first line\n")
    with open_output(tmp_path / "new.txt") as f:
        f.write("b\n")
    assert (tmp_path / "new.txt").read_text() == "b\n"


# ---- 3. files the user names: regular, bounded, never blocking ------------------------------------
def _fifo(path: Path) -> Path:
    import os
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("make, kind", [(lambda p: p.symlink_to("/dev/zero"), "a character device"),
                                        (_fifo, "a FIFO")], ids=["dev-zero", "fifo"])
def test_a_hardware_profile_that_is_not_a_file_is_refused_at_once(tmp_path, capsys, make, kind):
    from fxpipe import cli

    make(tmp_path / "hw.json")
    code = cli.main(["plan", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch", "8",
                     "--hardware", str(tmp_path / "hw.json")])
    err = capsys.readouterr().err
    assert code == 2 and f"hw.json is {kind}, not a regular file" in err and "Traceback" not in err, err


def test_a_weights_file_that_is_a_fifo_is_refused_without_waiting(tmp_path, monkeypatch, capsys):
    (tmp_path / "hf").mkdir()
    _fifo(tmp_path / "hf" / "model.safetensors")
    _refused(RUN + ["--init-from", tmp_path / "hf"], monkeypatch, capsys, "model.safetensors is a FIFO")


def test_a_metrics_file_that_is_a_fifo_is_refused_before_workers(tmp_path, monkeypatch, capsys):
    _refused(RUN + ["--metrics-file", _fifo(tmp_path / "m.jsonl")], monkeypatch, capsys,
             "--metrics-file", "m.jsonl is a FIFO, not a regular file")


# ---- 5/6. the API: types named, nothing after close(), one batch on every rank -------------------
def test_parallelize_names_the_argument_of_the_wrong_type():
    import torch

    from fxpipe.models.registry import build_workload
    from fxpipe.parallel import parallelize

    w = build_workload("gpt-tiny", batch=4, seq=8)
    batch = w.example_inputs
    cases = [(dict(model=lambda x: x, example_inputs=batch), r"takes the model as a torch.nn.Module, got function"),
             (dict(model=w.model, example_inputs={"ids": batch[0]}), r"example_inputs must be a tensor or a non-empty"),
             (dict(model=w.model, example_inputs=tuple(t.to("meta") for t in batch)),
              r"example_inputs\[0\] is on the meta device"),
             (dict(model=w.model, example_inputs=batch, loss_fn=3), r"loss_fn must be callable"),
             (dict(model=w.model, example_inputs=batch, tp="2", pp=1), r"tp must be an integer, got '2' \(str\)"),
             (dict(model=w.model, example_inputs=batch, pp=2, microbatches=2.5),
              r"microbatches must be an integer, got 2.5 \(float\)")]
    for kwargs, message in cases:
        model = kwargs.pop("model")
        with pytest.raises(TypeError, match=message):
            parallelize(model, **kwargs)
    assert not torch.distributed.is_initialized()  # refused before joining any group


def _misuse(rank, world):
    import torch

    from fxpipe.models.registry import build_workload
    from fxpipe.parallel import parallelize

    w = build_workload("gpt-tiny", batch=4, seq=8)
    pm = parallelize(w.model, example_inputs=w.example_inputs, loss_fn=w.loss_fn, pp=2, microbatches=2,
                     costs="model", partition="dp")
    out = {}
    first = pm.train_step(w.example_inputs)
    for name, batch in (("float", tuple(t.float() for t in w.example_inputs)),
                        ("dict", {"ids": w.example_inputs[0]})):
        try:
            pm.train_step(batch)
        except TypeError as exc:
            out[name] = str(exc)
    # Rank 1 reverses its rows: same sums, different order; every rank refuses alike.
    mine = w.example_inputs if rank == 0 else tuple(t.flip(0) for t in w.example_inputs)
    try:
        pm.train_step(mine)
    except ValueError as exc:
        out["differ"] = str(exc)
    out["again"] = pm.train_step(w.example_inputs)
    pm.close()
    pm.close()  # twice: nothing
    try:
        pm.train_step(w.example_inputs)
    except RuntimeError as exc:
        out["closed"] = str(exc)
    out["first"] = first
    del torch
    return out


@pytest.mark.slow
def test_misuse_of_a_parallel_model_is_refused_on_every_rank_and_training_goes_on():
    from tests.runtime._dist import run_world

    ranks = run_world(2, _misuse)
    for r in ranks:
        assert "batch tensor 0 has dtype torch.float32, the example batch's has torch.int64" in r["float"]
        assert "takes the batch as a tensor or a tuple of tensors" in r["dict"]
        assert ("the ranks of data-parallel replica 0 passed 2 different batches (ranks 0 one batch; ranks 1 one "
                "batch)") in r["differ"]
        assert "train_step after close()" in r["closed"]
        # No optimizer step between: a step after the refusals gives the first step's loss again.
        assert r["again"] == pytest.approx(r["first"], rel=1e-6)
    assert ranks[0]["again"] == ranks[1]["again"]


# ---- 4. model directories: what the config says is checked -------------------------------------
def test_seq_beyond_the_models_positions_is_refused_before_workers(tmp_path, monkeypatch, capsys):
    d = _llama_config(tmp_path / "m", max_position_embeddings=8)
    argv = [a for a in RUN if a != "gpt-tiny"]
    argv.insert(argv.index("--model") + 1, str(d))
    _refused(argv, monkeypatch, capsys, f"--seq 16 exceeds the 8 positions of {d}", "use --seq <= 8")


def _config_only_world(rank, world, directory):
    import math

    import torch

    from fxpipe.models.hf_dir import build_model
    from fxpipe.models.losses import next_token_loss
    from fxpipe.parallel import parallelize

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 17))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    pm = parallelize(build_model(directory), example_inputs=batch, loss_fn=next_token_loss, pp=2, microbatches=2,
                     costs="model", partition="uniform")
    loss = pm.train_step(batch)
    pm.close()
    return math.isfinite(loss)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_an_moe_config_directory_trains(tmp_path, family):
    """Built on meta and initialised shard by shard, its grouped experts' token counts
    traced on the GPU branch (histc of integers), which the device pass turns into the
    CPU's (passes/device.py)."""
    import transformers

    from tests.runtime._dist import run_world

    d = tmp_path / family
    shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=64, num_experts_per_tok=2)
    if family == "mixtral":
        transformers.MixtralConfig(intermediate_size=128, num_local_experts=4, **shape).save_pretrained(d)
    else:
        transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_experts=4,
                                    **shape).save_pretrained(d)
    assert run_world(2, _config_only_world, str(d)) == [True, True]


# ---- 5. nothing believed blindly --------------------------------------------------------------------
def test_a_resigned_cost_profile_of_impossible_times_is_refused_naming_the_group(tmp_path):
    import dataclasses

    from fxpipe.compiler.pipeline import capture_for, compile_program
    from fxpipe.costs import ProfileError, measured_profile, probe_groups
    from fxpipe.costs.profile import CostProfile, device_name, profile_key
    from fxpipe.ir.parallel_config import ParallelConfig
    from fxpipe.models.registry import build_workload

    import torch

    w = build_workload("gpt-tiny", batch=2, seq=16)
    config = ParallelConfig(costs="model")
    program = compile_program(capture_for(w.model, w.example_inputs, config, w.loss_fn), config, until="cost").program
    pconfig = config.partition_config(config.schedule_ir())
    _, probe = probe_groups(program, pconfig)
    n = len(probe.members)
    key = profile_key(program, probe, device_name(torch.device("cpu")), (1, 1, 1))
    base = CostProfile(key=key, device=device_name(torch.device("cpu")), groups=((1e-3, 2e-3, 1e-3, 1e-3),) * n,
                       latency_s=1e-5, bandwidth_bytes_per_s=1e9)

    def load(profile, name):
        return measured_profile(program, pconfig, str(profile.save(tmp_path / name)), device=torch.device("cpu"),
                                state_for=lambda names: {}, batch=w.example_inputs)

    assert load(base, "ok.json")[0] == base  # signed by save(): the check is on the numbers
    huge = dataclasses.replace(base, groups=((1e300, 1e300, 1e300, 1e300),) * n)
    with pytest.raises(ProfileError, match=r"group 0's fwd time is 1e\+300 s for one microbatch"):
        load(huge, "huge.json")
    odd = dataclasses.replace(base, groups=((1e-3, 2e-3, 1e-3, 1e-3),) * (n - 1) + ((1e3, 2e-3, 1e-3, 1e-3),))
    with pytest.raises(ProfileError, match=rf"group {n - 1}'s fwd time is .*x what the rest of the profile implies"):
        load(odd, "odd.json")


# ---- 3 (text). bounded pieces, UTF-8 or a refusal, links named ---------------------------------
def test_text_that_is_not_utf8_is_refused_naming_the_file_and_byte(tmp_path):
    from fxpipe.data.corpus import cached_tokens
    from fxpipe.data.tokenizer import ByteTokenizer, load_tokenizer
    from tests.data._corpus import train_bpe, write_corpus

    tok = load_tokenizer(train_bpe(tmp_path / "tok", write_corpus(tmp_path / "texts"), vocab_size=300))
    (tmp_path / "latin1.txt").write_bytes("un café crème".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: byte 6 \(b'\\xe9 cr'...\) is not UTF-8"):
        cached_tokens(tmp_path / "latin1.txt", tok)
    ids, _ = cached_tokens(tmp_path / "latin1.txt", ByteTokenizer())  # bytes as they are
    assert bytes(ids[:-1].astype("uint8")) == "un café crème".encode("latin-1")


def test_a_long_line_is_tokenized_in_bounded_pieces_cut_at_whitespace():
    import numpy as np

    from fxpipe.data.encode_pool import tokenize
    from fxpipe.data.text import pieces
    from fxpipe.data.tokenizer import ByteTokenizer
    from fxpipe.data.tokens import TokenDtype

    line = " ".join(f"w{i}" for i in range(400_000))  # one 2.6 MB line
    cut = pieces(line, limit=1 << 20)
    assert "".join(cut) == line and len(cut) == 3 and all(len(p) <= 1 << 20 for p in cut)
    assert all(p.endswith(" ") for p in cut[:-1])
    assert pieces("x" * 10, limit=4) == ["xxxx", "xxxx", "xx"]  # no whitespace: a hard cut
    ids = tokenize(iter([line.encode(), b"end"]), ByteTokenizer(), TokenDtype.fitting(256))
    assert np.array_equal(ids, np.frombuffer(line.encode() + b"\0end\0", dtype=np.uint8))  # one EOS per document


def test_linked_files_in_a_data_directory_are_reported(tmp_path, monkeypatch, capsys):
    from tests.test_preflight_trust import _launched

    texts = _corpus(tmp_path)
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not part of the data " * 50)
    (texts / "linked.txt").symlink_to(outside)
    _launched(RUN + ["--data", texts], monkeypatch, capsys)
    err = capsys.readouterr().err
    assert f"--data {texts}: 1 linked file(s) not read" in err and "linked.txt" in err, err


def test_a_tied_model_over_a_file_with_two_different_matrices_is_refused_naming_both(tmp_path, monkeypatch, capsys):
    """gpt-tiny ties its head to its embedding; a file holding a different lm_head.weight
    beside the embedding would lose one of them without a word."""
    import torch

    from fxpipe.models import build_workload
    from tests.test_preflight_trust import _launched, _weights

    table = build_workload("gpt-tiny", batch=1, seq=8).model.state_dict()["transformer.wte.weight"]
    _launched(RUN + ["--init-from", _weights(tmp_path, **{"lm_head.weight": table.clone()})], monkeypatch, capsys)
    d = _weights(tmp_path, **{"lm_head.weight": torch.randn_like(table)})  # the same matrix twice above: fine
    _refused(RUN + ["--init-from", d], monkeypatch, capsys, "transformer.wte.weight and lm_head.weight are one tied "
             "parameter in the model", "different tensors in the file")


# ---- 6. errors a user can act on ----------------------------------------------------------------
def test_a_full_disk_during_a_save_is_named_enospc_with_the_bytes(tmp_path):
    import errno

    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from fxpipe.checkpoint.dcp import save_error

    state = {"model": {"w": torch.zeros(1024, 256)}, "optim": {"m": [torch.zeros(10)]}}  # 1 MiB + 40 B
    full = OSError(errno.ENOSPC, "No space left on device")
    exc = CheckpointException("save failed", {0: (full, None), 1: (RuntimeError("peer gone"), None)})
    err = save_error(exc, tmp_path / "step_00000010", tmp_path / ".tmp", state)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert "no space left on device (ENOSPC)" in str(err) and "writes about 1048616 bytes" in str(err)
    other = save_error(CheckpointException("x", {1: (RuntimeError("boom\nmore"), None)}), tmp_path / "s", tmp_path, {})
    assert isinstance(other, RuntimeError) and "rank 1: RuntimeError: boom more" in str(other)
    assert "\n" not in str(other)


def test_a_model_whose_state_cannot_fit_is_refused_before_workers(tmp_path, monkeypatch, capsys):
    d = _llama_config(tmp_path / "huge", num_hidden_layers=2, hidden_size=1 << 16, intermediate_size=1 << 16,
                      num_attention_heads=32, num_key_value_heads=32)
    argv = [a for a in RUN if a != "gpt-tiny"]
    argv.insert(argv.index("--model") + 1, str(d))
    # Refused from the config's sizes before the capture (job/preflight_sizes.py; the exact
    # per-layout check after the capture is check_state_fits).
    err = _refused(argv, monkeypatch, capsys, "parameters (2 layers, width 65536, vocabulary 300)",
                   "training state needs at least", "(16 bytes each", "GiB free on this machine")
    assert "use a smaller model, more ranks" in err


def _mixtral_dir(path: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=96, vocab_size=256, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return path


def test_per_expert_tensors_on_disk_are_read_as_the_models_stacked_ones(tmp_path):
    """transformers' own save_pretrained writes Mixtral one tensor per expert
    (block_sparse_moe.experts.3.w1.weight); the model holds them stacked (mlp.experts.
    gate_up_proj). Every tensor, and every region a rank may read of it, equals what
    from_pretrained builds."""
    import torch
    import transformers

    from fxpipe.params.hf_weights import WeightsDir

    d = _mixtral_dir(tmp_path / "mixtral")
    w = WeightsDir(d)
    assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in w.files)  # the layout on disk
    reference = transformers.MixtralForCausalLM.from_pretrained(d).state_dict()
    assert set(w.shapes) == set(reference)
    for name, t in reference.items():
        assert torch.equal(w.region(name, 0, 0, t.shape[0]), t), name
    gate_up = reference["model.layers.1.mlp.experts.gate_up_proj"]  # (E, 2I, H): gate rows, then up rows
    for dim, a, b in ((0, 1, 3), (1, 50, 150), (1, 96, 192), (2, 8, 40)):
        assert torch.equal(w.region("model.layers.1.mlp.experts.gate_up_proj", dim, a, b), gate_up.narrow(dim, a, b - a))


def _mixtral_world(rank, world, directory):
    import torch
    import transformers

    from fxpipe.models.hf_dir import build_model
    from fxpipe.models.losses import next_token_loss
    from fxpipe.parallel import parallelize

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 17))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    pm = parallelize(build_model(directory), example_inputs=batch, loss_fn=next_token_loss, weights=directory,
                     pp=2, microbatches=2, costs="model", partition="uniform")
    loss = pm.train_step(batch)
    eager = transformers.MixtralForCausalLM.from_pretrained(directory)
    expected = next_token_loss(eager(batch[0], use_cache=False), batch[1]).item()
    pm.close()
    return loss, expected


@pytest.mark.slow
def test_a_mixtral_saved_by_transformers_trains_from_its_weights(tmp_path):
    from tests.runtime._dist import run_world

    d = _mixtral_dir(tmp_path / "mixtral")
    for loss, expected in run_world(2, _mixtral_world, str(d)):
        assert loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("decoder", [False, True])
def test_a_bidirectional_encoder_is_refused_as_a_causal_lm(tmp_path, monkeypatch, capsys, decoder):
    """BERT through AutoModelForCausalLM without is_decoder attends both ways: its targets
    would be in its inputs. The attention mask is read off the captured graph."""
    import transformers

    from tests.test_preflight_trust import _launched

    d = tmp_path / "bert"
    transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                            vocab_size=300, max_position_embeddings=64, is_decoder=decoder).save_pretrained(d)
    argv = [a for a in RUN if a != "gpt-tiny"]
    argv.insert(argv.index("--model") + 1, str(d))
    if decoder:
        _launched(argv, monkeypatch, capsys)
    else:
        _refused(argv, monkeypatch, capsys, "its attention lets a position see later ones", "is_decoder")


def test_a_profile_of_impossible_times_is_refused_before_workers(tmp_path):
    """The launcher's preflight holds the graph the workers will compile: a profile's
    numbers are judged there (which graph it was measured for, the workers check)."""
    import dataclasses

    from fxpipe.compiler.pipeline import capture_for, compile_program
    from fxpipe.costs import probe_groups
    from fxpipe.costs.profile import CostProfile
    from fxpipe.ir.parallel_config import ParallelConfig
    from fxpipe.job.preflight import check_profile_numbers
    from fxpipe.job.preflight_files import PreflightError
    from fxpipe.models.registry import build_workload

    w = build_workload("gpt-tiny", batch=2, seq=16)
    layout = ParallelConfig(tp=1, pp=2, microbatches=2, costs="model")
    program = compile_program(capture_for(w.model, w.example_inputs, layout, w.loss_fn), layout, until="cost").program
    n = len(probe_groups(program, layout.partition_config(layout.schedule_ir()))[1].members)
    path = CostProfile(key="k", device="cpu", groups=((1e300,) * 4,) * n, latency_s=0.0,
                       bandwidth_bytes_per_s=1e9).save(tmp_path / "p.json")
    with pytest.raises(PreflightError, match=r"--costs .*p.json: group 0's fwd time is 1e\+300 s"):
        check_profile_numbers(program, dataclasses.replace(layout, costs=str(path)))


@pytest.mark.parametrize("command", ["run", "compile"])
def test_a_hardware_profile_that_is_a_device_is_refused_by_run_and_compile(tmp_path, monkeypatch, capsys, command):
    (tmp_path / "hw.json").symlink_to("/dev/zero")
    argv = (RUN if command == "run" else ["compile", "--model", "gpt-tiny", "--seq", "16", "--batch", "4",
                                          "--pp", "2", "--costs", "model"]) + ["--hardware", tmp_path / "hw.json"]
    _refused(argv, monkeypatch, capsys, "hw.json is a character device, not a regular file")

