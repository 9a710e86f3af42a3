"""Checkpoints (DCP): exact resume, other layouts, kill -9 during a save, export
(`fxpipe run` with checkpoints: test_checkpoint_cli.py).

Worlds are spawned once per size and run several checks each (see _ckpt_cases.py):
on a 2-core machine spawning and compiling cost far more than the checks.
"""
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpipe.cli import main
from fxpipe.models.losses import causal_lm_loss
from fxpipe.checkpoint.dcp import latest_checkpoint, list_checkpoints, step_dirname
from fxpipe.checkpoint.export import export_consolidated
from fxpipe.checkpoint.files import SafeReader
from tests.checkpoint import _ckpt_cases as cases
from tests.runtime import _wide_vocab
from tests.runtime._dist import run_world

ROOT = Path(__file__).resolve().parents[2]


# ---- single process: the directory protocol ---------------------------------------------------
def _fake_checkpoint(root: Path, step: int, suffix: str = "") -> Path:
    """A directory with a well-formed manifest listing its one (empty) file."""
    from fxpipe.checkpoint.manifest import digest

    path = root / (step_dirname(step) + suffix)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    meta = dict(format=2, step=step, extra={}, world_size=1, mesh=dict(pp=1, dp=1, tp=1), state_dict={},
                source="M", precision="fp32", loss_scaler=None, files={".metadata": digest(path / ".metadata")})
    (path / "fxpipe.json").write_text(json.dumps(meta))
    return path


def test_partial_and_dangling_checkpoints_are_ignored(tmp_path):
    _fake_checkpoint(tmp_path, 1)
    _fake_checkpoint(tmp_path, 3, ".tmp")  # complete-looking, never renamed
    (tmp_path / step_dirname(2)).mkdir()  # renamed dirs always hold both files; this one does not
    (tmp_path / "latest").write_text(step_dirname(5) + "\n")  # pointer to a pruned/missing one
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert latest_checkpoint(tmp_path).name == step_dirname(1)
    _fake_checkpoint(tmp_path, 4)
    (tmp_path / "latest").write_text(step_dirname(1))
    assert latest_checkpoint(tmp_path).name == step_dirname(1), "a valid pointer wins"
    assert latest_checkpoint(tmp_path / "nowhere") is None


@pytest.mark.parametrize("argv,message", [
    (["--resume"], "need --checkpoint-dir"),
    (["--save-interval", "2"], "need --checkpoint-dir"),
    (["--resume-from", "3"], "need --checkpoint-dir"),
    (["--checkpoint-dir", "x", "--resume-from", "-1"], "--resume-from must be a step >= 0, got -1"),
])
def test_bad_checkpoint_flags_fail_fast(capsys, argv, message):
    assert main(["run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_resume_without_checkpoint_fails_fast(capsys, tmp_path):
    assert main(["run", "--checkpoint-dir", str(tmp_path), "--resume"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    _fake_checkpoint(tmp_path, 1)
    assert main(["run", "--checkpoint-dir", str(tmp_path), "--resume-from", "7"]) == 2
    assert "no complete checkpoint for step 7 in" in capsys.readouterr().err


# ---- spawned worlds ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """kill -9 during a save: the previous checkpoint must survive, the partial one be ignored."""
    root = tmp_path_factory.mktemp("killed")
    directory, expected = root / "ckpt", root / "step1.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tests.checkpoint._ckpt_cases import save_then_hang; "
                               "save_then_hang(*sys.argv[1:])", str(directory), str(expected), str(root / "store")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "WRITTEN":
                break
        partial = next(directory.glob(step_dirname(2) + ".*.tmp"), directory / "none")  # step_N.<job>.tmp
        state = dict(partial=partial.is_dir() and any(partial.glob("*.distcp")),
                     index_written=(partial / ".metadata").exists())
    finally:
        proc.kill()  # SIGKILL: no handler, no cleanup
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    return directory, expected, state


@pytest.fixture(scope="module")
def world2(tmp_path_factory, killed):
    root = tmp_path_factory.mktemp("ckpt")
    out = run_world(2, cases.world_pp2, str(root), str(killed[0]))
    return root, out


@pytest.fixture(scope="module")
def world4(world2):
    return run_world(4, cases.world_reshard, str(world2[0]))


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run_exactly(world2):
    for r in world2[1]:
        assert r["resumed_step"] == cases.SAVE_AT
        assert r["resumed_losses"] == r["losses"][cases.SAVE_AT:]  # bitwise
        assert r["rng_after_load"] == r["rng_after_save"]
    r = world2[1][0]
    assert set(r["resumed_params"]) == set(r["params"])
    for name, p in r["params"].items():
        assert torch.equal(r["resumed_params"][name], p), name


def _assert_resumed_like(world4, key, reference):
    for rank_results in world4:
        r = rank_results[key]
        assert r["step"] == cases.SAVE_AT
        assert r["losses"] == pytest.approx(reference["losses"][cases.SAVE_AT:], abs=1e-6, rel=0)
    params = world4[0][key]["params"]
    assert set(params) == set(reference["params"])
    for name, p in params.items():
        # AdamW turns round-off of a different reduction order into lr-sized steps on
        # near-zero gradients (test_equivalence.py), so parameters match to 1e-5.
        torch.testing.assert_close(p, reference["params"][name], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp4", "dp2xpp2", "tp2xpp2"])
def test_pp2_checkpoint_loads_into_another_layout(world2, world4, layout):
    _assert_resumed_like(world4, (layout, "run"), world2[1][0])
    for rank_results in world4:
        # Another layout: every rank takes rank 0's RNG streams (a fresh run seeds all alike).
        assert rank_results[(layout, "run")]["rng"] == world2[1][0]["rng_after_save"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp4", "dp2xpp2", "tp4"])
def test_tp_checkpoint_loads_into_another_layout(world4, layout):
    """Saved at tp=2 × pp=2 as per-rank chunks: tp=1 reads whole tensors, tp=4 its ranges."""
    _assert_resumed_like(world4, (layout, "tp2"), world4[0]["tp2"])


@pytest.mark.slow
def test_tp_checkpoint_holds_each_shard_once(world2, world4):
    """Saved at tp=2 × pp=2 without gathering: global shapes, and the chunks of every
    tensor tile it exactly once (tp ranks wrote their own ranges; tied copies and
    replicas were deduplicated)."""
    path = latest_checkpoint(world2[0] / "tp2")
    index = SafeReader(path).read_metadata().state_dict_metadata
    full = cases.workload().model.state_dict()
    model = {k[len("model."):]: md for k, md in index.items() if k.startswith("model.")}
    assert set(model) == set(full) - {"lm_head.weight"}
    for name, md in model.items():
        assert tuple(md.size) == tuple(full[name].shape), name
    moments = {k: md for k, md in index.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert len(moments) == 2 * len(model)
    for key, md in moments.items():
        assert tuple(md.size) == tuple(full[key[len("optim.state."):].rsplit(".", 1)[0]].shape), key
    sharded = 0
    for key, md in index.items():
        cover = torch.zeros(tuple(md.size), dtype=torch.int32)
        for c in md.chunks:
            cover[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
        assert bool((cover == 1).all()), key
        sharded += len(md.chunks) > 1
    assert sharded >= 2 * 4, "each layer's column/row-parallel weights and their moments are chunked"


# "rows": the head cut into blocks spread by the partition (split_loss); "vocab_rows": the
# head run as vocabulary passes, rank r owning block r (vocab_passes).
@pytest.mark.slow
@pytest.mark.parametrize("run", ["rows", "vocab_rows"])
def test_owned_rows_resume_into_another_row_layout(world2, world4, run):
    """Saved at pp=2 with each rank holding its rows of the LM head and of the embedding
    (looked up by the rows' owners); loaded at pp=4, where the ranks own other rows:
    losses and parameters continue the saving run."""
    saved, resumed = world2[1][0][run], world4[0][("pp4", run)]
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        assert saved["rows"][name] != resumed["rows"][name], name
    _assert_resumed_like(world4, ("pp4", run), saved)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["rows", "vocab_rows"])
def test_owned_rows_are_written_as_each_ranks_chunks(world2, run):
    """No rank wrote the whole head or the whole embedding: their chunks are the ranks'
    row ranges, tiling each once (the parameter and its Adam moments), and each rank held
    only its rows (the first rank too: its stage reads the embedding as the owners' sum)."""
    r = world2[1]
    index = SafeReader(latest_checkpoint(world2[0] / run)).read_metadata().state_dict_metadata
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        ranks = r[0][run]["rows"][name]
        if run == "vocab_rows":  # rank r owns block r of the vocabulary
            assert ranks == (((0, _wide_vocab.VOCAB // 2),), ((_wide_vocab.VOCAB // 2, _wide_vocab.VOCAB),)), name
        for pp_rank, rank_results in enumerate(r):
            assert rank_results[run]["local"][name][0] == sum(b - a for a, b in ranks[pp_rank]) < _wide_vocab.VOCAB
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
            md = index[key]
            assert tuple(md.size) == (_wide_vocab.VOCAB, _wide_vocab.WIDTH)
            assert sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in md.chunks) == \
                sorted(ab for held in ranks for ab in held), key


@pytest.mark.slow
def test_column_split_conv1d_resumes_under_tp(world4):
    """HF GPT-2's Conv1D weights split by columns at tp=2 (non-contiguous ranges of the
    local tensor): saved and resumed, the run continues exactly."""
    _assert_resumed_like(world4, ("tp2xpp2", "hf_tp2"), world4[0]["hf_tp2"])


@pytest.mark.slow
def test_tp_vocab_rows_are_written_as_each_ranks_chunks(world2, world4):
    """tp=2 × pp=2 with vocabulary passes: every rank holds a quarter of the head's and the
    embedding's rows (block pp_rank of its TP shard) and wrote exactly those rows, the four
    ranks' chunks tiling each tensor (and its Adam moments) once."""
    v, quarter = _wide_vocab.VOCAB, _wide_vocab.VOCAB // 4
    index = SafeReader(latest_checkpoint(world2[0] / "tp2_vocab_rows")).read_metadata().state_dict_metadata
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for rank_results in world4:
            r = rank_results["tp2_vocab_rows"]
            assert r["rows"][name] == (((0, v // 4),), ((v // 4, v // 2),)), name  # of the TP shard's V/2 rows
            assert r["local"][name] == (quarter, _wide_vocab.WIDTH), name
        expected = sorted((r["tp_rank"] * v // 2 + r["pp_rank"] * quarter,
                           r["tp_rank"] * v // 2 + (r["pp_rank"] + 1) * quarter)
                          for r in (rank_results["tp2_vocab_rows"] for rank_results in world4))
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
            md = index[key]
            assert tuple(md.size) == (v, _wide_vocab.WIDTH)
            assert sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in md.chunks) == expected, key


@pytest.mark.slow
def test_tp_vocab_rows_checkpoints_resume_across_layouts(world2, world4):
    """The tp=2 × pp=2 vocabulary passes' checkpoint resumed at pp=4 (other rows per
    rank, no TP) continues the saving run, and the pp=2 one resumed at tp=2 × pp=2."""
    _assert_resumed_like(world4, ("pp4", "tp2_vocab_rows"), world4[0]["tp2_vocab_rows"])
    _assert_resumed_like(world4, ("tp2xpp2", "vocab_rows"), world2[1][0]["vocab_rows"])


@pytest.mark.slow
@pytest.mark.parametrize("run", ["rows", "vocab_rows", "tp2_vocab_rows"])
def test_owned_rows_export_whole_tensors(world2, world4, run):
    from safetensors.torch import load_file

    exported = load_file(world2[0] / f"{run}_export" / "model.safetensors")
    params = (world4 if run.startswith("tp2") else world2[1])[0][run]["params"]
    assert set(exported) == set(params)
    for name, p in params.items():
        assert torch.equal(exported[name], p), name


@pytest.mark.slow
def test_export_under_tp_loads_into_the_unmodified_model(world2, world4):
    w = cases.workload(seed=5)
    state = torch.load(world2[0] / "gpt_tp2.pt", weights_only=True)
    w.model.load_state_dict(state, strict=True)
    for name, p in world4[0]["tp2"]["params"].items():
        assert torch.equal(state[name], p), name
    x, y = cases.batch(w, cases.EVAL_STEP)
    with torch.no_grad():
        loss = w.model(x, y)
    assert float(loss) == pytest.approx(world4[0]["tp2"]["eval_loss"], abs=1e-6, rel=0)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_resume_is_exact(world2, precision):
    for r in (rank_results[precision] for rank_results in world2[1]):
        assert r["resumed_losses"] == r["losses"][cases.SAVE_AT:]  # bitwise
        assert set(r["resumed_masters"]) == set(r["masters"])
        for name, m in r["masters"].items():
            assert m.dtype == torch.float32 and torch.equal(r["resumed_masters"][name], m), name
        assert str({"bf16": torch.bfloat16, "fp16": torch.float16}[precision]) in r["dtypes"]
        assert r["scaler_loaded"] == r["scaler_saved"]
        assert r["scaler_resumed_end"] == r["scaler_end"]
        if precision == "fp16":
            assert r["scaler_saved"]["skipped"] >= 1, "the first steps overflow"
            assert r["scaler_saved"] != r["scaler_end"], "the scale moved on after the save"
    index = SafeReader(latest_checkpoint(world2[0] / precision)).read_metadata().state_dict_metadata
    assert {md.properties.dtype for k, md in index.items() if k.startswith("model.")} == {torch.float32}, \
        "the fp32 masters are saved, not the 16-bit compute copies"


@pytest.mark.slow
def test_kill_during_save_keeps_the_last_good_checkpoint(killed, world2):
    directory, expected, state = killed
    assert state == dict(partial=True, index_written=False), "killed while DCP was mid-save"
    assert [s for s, _ in list_checkpoints(directory)] == [1]
    assert latest_checkpoint(directory).name == step_dirname(1)
    saved = torch.load(expected, weights_only=True)
    for r in world2[1]:
        assert r["killed_step"] == 1  # saved by pp=1, loaded by pp=2
    for name, p in world2[1][0]["killed_params"].items():
        assert torch.equal(p, saved[name]), name


@pytest.mark.slow
def test_keep_last_and_resave(world2):
    assert world2[1][0]["kept"] == [2, 3]


@pytest.mark.slow
def test_checkpoint_of_another_model_names_the_keys(world2):
    message = world2[1][0]["mismatch"]
    assert message is not None and "unexpected: transformer.h.2." in message
    assert "missing: none" in message


@pytest.mark.slow
@pytest.mark.parametrize("name,file,key", [("gpt-tiny", "gpt.pt", "eval_loss"),
                                           ("hf:gpt2", "hf_gpt2.pt", "hf_eval_loss")])
def test_export_loads_into_the_unmodified_model(world2, name, file, key):
    root, out = world2
    w = cases.workload(name, seed=5)  # another init: every weight must come from the file
    state = torch.load(root / file, weights_only=True)
    assert {"transformer.wte.weight", "lm_head.weight"} <= set(state)
    assert set(state) == set(w.model.state_dict())
    w.model.load_state_dict(state, strict=True)
    x, y = cases.batch(w, cases.EVAL_STEP)
    with torch.no_grad():
        loss = w.model(x, y) if w.loss_fn is None else causal_lm_loss(w.model(x), y)
    assert float(loss) == pytest.approx(out[0][key], abs=1e-6, rel=0)


@pytest.mark.slow
def test_hf_export_directory_loads_with_from_pretrained(world2):
    """The live export of an HF model as safetensors + config.json (streamed, tied
    weights once): ``from_pretrained`` reproduces the trained model's loss."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    root, out = world2
    path = root / "hf_gpt2_dir"
    assert {"config.json", "model.safetensors"} <= {f.name for f in path.iterdir()}
    with safe_open(path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys()), "tied weights are stored once, as save_pretrained does"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    w = cases.workload("hf:gpt2")
    x, y = cases.batch(w, cases.EVAL_STEP)
    with torch.no_grad():
        loss = causal_lm_loss(model(x), y)
    assert float(loss) == pytest.approx(out[0]["hf_eval_loss"], abs=1e-6, rel=0)


@pytest.mark.slow
def test_sharded_safetensors_export_equals_the_pt_export(world2, tmp_path):
    """From a checkpoint directory, split into files of at most 40 KB with an index
    (Hugging Face's layout): the same tensors as the torch.save export."""
    from safetensors.torch import load_file

    root, _ = world2
    reference = export_consolidated(root / "keep", tmp_path / "m.pt")
    files = export_consolidated(root / "keep", tmp_path / "st", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == sorted(f.name for f in files)
    loaded = {}
    for f in files:
        assert f.stat().st_size < 40_000 + 64 * 1024 or len(load_file(f)) == 1
        loaded.update(load_file(f))
    assert set(loaded) == set(reference) - {"lm_head.weight"}
    for name, t in loaded.items():
        assert torch.equal(t, reference[name]), name


@pytest.mark.slow
def test_export_from_a_directory_and_each_tensor_stored_once(world2, tmp_path):
    root, out = world2
    state = export_consolidated(root / "keep", tmp_path / "m.pt")  # no process group here
    params = out[0]["params"]  # "keep" was saved after the last optimizer step
    assert torch.load(tmp_path / "m.pt", weights_only=True).keys() == state.keys()
    assert torch.equal(state["lm_head.weight"], params["transformer.wte.weight"])
    assert all(torch.equal(state[n], p) for n, p in params.items())
    index = SafeReader(latest_checkpoint(root / "keep")).read_metadata()
    assert "model.lm_head.weight" not in index.state_dict_metadata, "a tied group is one tensor"
    # Replicas (tied copies on both pipeline ranks) are written by one rank only.
    assert all(len(md.chunks) == 1 for md in index.state_dict_metadata.values())
    assert len(index.storage_data) == len(index.state_dict_metadata)


def test_tp_dropout_streams_round_trip_through_the_rng_state():
    """The TP dropout generators (sharded and replicated streams) are saved per rank
    and rewound on load, so a resumed tp>1 run draws the masks it would have drawn."""
    from fxpipe.checkpoint.dcp import _rng_state, _set_rng
    from fxpipe.tp import DropoutRNG

    rng = DropoutRNG(seed=3, tp_rank=1)
    cpu = torch.device("cpu")
    for sharded in (False, True):
        torch.rand(5, generator=rng.generator(cpu, sharded))
    saved = {k[len("rng.0."):]: v.clone() for k, v in _rng_state(0, cpu, rng).items()}
    expected = [torch.rand(5, generator=rng.generator(cpu, s)) for s in (False, True)]
    _set_rng(saved, cpu, rng)
    again = [torch.rand(5, generator=rng.generator(cpu, s)) for s in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(expected, again))
    assert not torch.equal(expected[0], expected[1]), "the two streams differ"
