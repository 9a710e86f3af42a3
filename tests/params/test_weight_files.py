"""Weights read from disk: a tied model over a file with two different matrices is refused naming
both; per-expert tensors on disk are read as the model's stacked ones."""
from __future__ import annotations


from tests.job._cli import RUN, refused
from tests.models._model_dirs import mixtral_64_dir


def test_a_tied_model_over_a_file_with_two_different_matrices_is_refused_naming_both(tmp_path, monkeypatch, capsys):
    """gpt-tiny ties its head to its embedding; a file holding a different lm_head.weight
    beside the embedding would lose one of them without a word."""
    import torch

    from fxpipe.models import build_workload
    from tests.job._cli import hf_weights, launched

    table = build_workload("gpt-tiny", batch=1, seq=8).model.state_dict()["transformer.wte.weight"]
    launched(RUN + ["--init-from", hf_weights(tmp_path, **{"lm_head.weight": table.clone()})], monkeypatch, capsys)
    d = hf_weights(tmp_path, **{"lm_head.weight": torch.randn_like(table)})  # the same matrix twice above: fine
    refused(RUN + ["--init-from", d], monkeypatch, capsys, "transformer.wte.weight and lm_head.weight are one tied "
             "parameter in the model", "different tensors in the file")


def test_per_expert_tensors_on_disk_are_read_as_the_models_stacked_ones(tmp_path):
    """transformers' own save_pretrained writes Mixtral one tensor per expert
    (block_sparse_moe.experts.3.w1.weight); the model holds them stacked (mlp.experts.
    gate_up_proj). Every tensor, and every region a rank may read of it, equals what
    from_pretrained builds."""
    import torch
    import transformers

    from fxpipe.params.hf_weights import WeightsDir

    d = mixtral_64_dir(tmp_path / "mixtral")
    w = WeightsDir(d)
    assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in w.files)  # the layout on disk
    reference = transformers.MixtralForCausalLM.from_pretrained(d).state_dict()
    assert set(w.shapes) == set(reference)
    for name, t in reference.items():
        assert torch.equal(w.region(name, 0, 0, t.shape[0]), t), name
    gate_up = reference["model.layers.1.mlp.experts.gate_up_proj"]  # (E, 2I, H): gate rows, then up rows
    for dim, a, b in ((0, 1, 3), (1, 50, 150), (1, 96, 192), (2, 8, 40)):
        assert torch.equal(w.region("model.layers.1.mlp.experts.gate_up_proj", dim, a, b), gate_up.narrow(dim, a, b - a))
