"""Deferred initialisation (fxpipe/params/deferred_init.py): rules recorded from the model's own init,
replayed shard by shard; the same values for every layout."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxpipe.params.deferred_init import InitError, materialize, materialize_, materialize_tensor, record_init
from fxpipe.models import build_workload
from fxpipe.passes.tensor_parallel import ShardKind, ShardSpec, shard_state
from tests.runtime import _init_cases as cases
from tests.runtime._dist import run_world


@pytest.fixture(scope="module")
def gpt():
    model = build_workload("gpt-tiny", device="meta").model
    return model, record_init(model), materialize(model, seed=5)


SPECS = [  # dim 0, dim 1, non-contiguous (fused QKV-like), vocab with a padding row
    ShardSpec("transformer.h.0.mlp.c_fc.weight", ShardKind.COLUMN, (256, 64), (128, 64), 0,
              (((0, 128),), ((128, 256),))),
    ShardSpec("transformer.h.0.mlp.c_proj.weight", ShardKind.ROW, (64, 256), (64, 128), 1,
              (((0, 128),), ((128, 256),))),
    ShardSpec("transformer.h.0.attn.c_attn.weight", ShardKind.COLUMN, (192, 64), (96, 64), 0,
              (((0, 32), (64, 96), (128, 160)), ((32, 64), (96, 128), (160, 192)))),
    ShardSpec("transformer.wte.weight", ShardKind.VOCAB, (256, 64), (129, 64), 0,
              (((0, 129),), ((129, 256),))),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind.value}-dim{s.dim}-{len(s.ranges[0])}ranges")
def test_a_shard_equals_the_same_slice_of_the_whole_tensor(gpt, spec):
    model, rules, full = gpt
    for rank in range(spec.tp):
        shard = materialize_tensor(rules, spec.name, 5, spec, rank)
        assert torch.equal(shard, shard_state({spec.name: full[spec.name]}, {spec.name: spec}, rank)[spec.name])


def test_values_follow_the_models_own_init(gpt):
    model, _, full = gpt
    assert torch.equal(full["transformer.h.0.ln_1.weight"], torch.ones(64))
    assert torch.equal(full["transformer.h.0.attn.c_attn.bias"], torch.zeros(192))
    assert abs(float(full["transformer.h.0.mlp.c_fc.weight"].std()) - 0.02) < 0.002
    assert full["lm_head.weight"] is full["transformer.wte.weight"], "tied names share one tensor"
    assert not torch.equal(full["transformer.h.0.mlp.c_fc.weight"], full["transformer.h.1.mlp.c_fc.weight"])
    assert torch.equal(materialize(model, seed=5)["transformer.wpe.weight"], full["transformer.wpe.weight"])
    assert not torch.equal(materialize(model, seed=6)["transformer.wpe.weight"], full["transformer.wpe.weight"])


def test_views_and_computed_buffers():
    """Llama: the padding row zeroed through a view; the rotary table computed by its
    module's init on the CPU."""
    model = build_workload("hf:llama", device="meta").model
    full = materialize(model, seed=0)
    emb = full["model.embed_tokens.weight"]
    assert torch.equal(emb[model.model.embed_tokens.padding_idx], torch.zeros(emb.shape[1]))
    assert float(emb[1:].abs().sum()) > 0
    inv = full["model.rotary_emb.inv_freq"]
    assert torch.allclose(inv, 1.0 / (model.config.rope_parameters["rope_theta"]
                                      ** (torch.arange(0, 2 * inv.numel(), 2).float() / (2 * inv.numel()))))


def test_materialize_in_place_keeps_ties():
    model = materialize_(build_workload("gpt-tiny", device="meta").model, seed=1)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not any(p.is_meta for p in model.parameters())


def test_init_that_cannot_be_replayed_is_named():
    class Orthogonal(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

        def reset_parameters(self):
            with torch.no_grad():
                self.w.copy_(torch.eye(4, device=self.w.device))  # a computed tensor

    with torch.device("meta"):
        model = Orthogonal()
    with pytest.raises(InitError, match="w: its init applies copy_ with a tensor argument.* pass init_fn="):
        record_init(model)


def test_parameter_without_init_is_named():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = Bare()
    with pytest.raises(InitError, match="parameter scale has no init rule"):
        record_init(model)
    rules = record_init(model, init_fn=lambda m: nn.init.constant_(m.scale, 2.0))
    assert torch.equal(materialize(model, rules=rules)["scale"], torch.full((3,), 2.0))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face GPT-2 written by save_pretrained, and its loss on the batch."""
    w = build_workload("hf:gpt2", batch=cases.BATCH, seq=cases.SEQ, seed=7)
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    w.model.save_pretrained(path)
    x, y = cases.batch("hf:gpt2")
    with torch.no_grad():
        losses = [float(w.loss_fn(w.model(a), b)) for a, b in zip(x.chunk(cases.MICRO), y.chunk(cases.MICRO))]
    return path, sum(losses) / len(losses)


@pytest.fixture(scope="module")
def world4(hf_dir):
    return run_world(4, cases.world_meta, str(hf_dir[0]))


@pytest.mark.slow
def test_hf_directory_loads_slice_by_slice_into_any_layout(world4, hf_dir):
    for rank_results in world4:
        assert rank_results[-1]["loss"] == pytest.approx(hf_dir[1], rel=1e-6)
    message = world4[0][-1]["mismatch"]
    assert "do not match the model: missing: transformer.h.2." in message, message


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(cases.CASES)), ids=lambda i: str(cases.CASES[i]))
def test_meta_model_trains_like_one_process(world4, index):
    """Built on meta, each rank materialised only its shards; the losses equal one
    process trained from the public function's weights."""
    reference = cases.reference(cases.CASES[index]["model"])
    for rank_results in world4:
        assert rank_results[index]["losses"] == pytest.approx(reference, rel=1e-6)
        assert rank_results[index]["meta_left"] < rank_results[index]["local"], \
            "the plan keeps no real copy of the parameters"
