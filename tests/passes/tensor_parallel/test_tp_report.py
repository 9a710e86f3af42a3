"""The sharding found for each family, and the collectives per layer (Megatron:
2 all-reduces forward and 2 backward per transformer layer without sp)."""
from collections import Counter

import pytest

from fxpipe.passes.tensor_parallel import BlockKind, Comm, ShardKind, render_sharding_report
from tests._shared import FIVE_MODELS
from tests.passes.tensor_parallel._tp_helpers import compile_tp

C, R, V, REP = ShardKind.COLUMN, ShardKind.ROW, ShardKind.VOCAB, ShardKind.REPLICATED

EXPECTED = {
    "gpt-tiny": {"transformer.h.0.attn.c_attn.weight": C, "transformer.h.0.attn.c_attn.bias": C,
                 "transformer.h.0.attn.c_proj.weight": R, "transformer.h.0.attn.c_proj.bias": REP,
                 "transformer.h.1.mlp.c_fc.weight": C, "transformer.h.1.mlp.c_proj.weight": R,
                 "transformer.h.0.ln_1.weight": REP, "transformer.wpe.weight": REP,
                 "transformer.wte.weight": V, "lm_head.weight": V},
    "hf:gpt2": {"transformer.h.0.attn.c_attn.weight": C, "transformer.h.0.attn.c_proj.weight": R,
                "transformer.h.0.mlp.c_fc.weight": C, "transformer.h.0.mlp.c_proj.weight": R,
                "transformer.wte.weight": V, "lm_head.weight": V, "transformer.wpe.weight": REP},
    "hf:llama": {"model.layers.0.self_attn.q_proj.weight": C, "model.layers.0.self_attn.k_proj.weight": C,
                 "model.layers.0.self_attn.v_proj.weight": C, "model.layers.0.self_attn.o_proj.weight": R,
                 "model.layers.0.mlp.gate_proj.weight": C, "model.layers.0.mlp.up_proj.weight": C,
                 "model.layers.0.mlp.down_proj.weight": R, "model.layers.0.input_layernorm.weight": REP,
                 "model.embed_tokens.weight": V, "lm_head.weight": V, "model.norm.weight": REP},
    "hf:gpt_neox": {"gpt_neox.layers.0.attention.query_key_value.weight": C,
                    "gpt_neox.layers.0.attention.dense.weight": R,
                    "gpt_neox.layers.0.mlp.dense_h_to_4h.weight": C,
                    "gpt_neox.layers.0.mlp.dense_4h_to_h.weight": R,
                    "gpt_neox.embed_in.weight": V, "lm_head.weight": V},
    "hf:opt": {"model.decoder.layers.0.self_attn.q_proj.weight": C,
               "model.decoder.layers.0.self_attn.out_proj.weight": R,
               "model.decoder.layers.0.fc1.weight": C, "model.decoder.layers.0.fc2.weight": R,
               "model.decoder.embed_tokens.weight": V, "lm_head.weight": V,
               "model.decoder.embed_positions.weight": REP},
}


@pytest.mark.parametrize("name", FIVE_MODELS)
def test_placements_per_family(name):
    _, program, _ = compile_tp(name, 2)
    result = program.tensor_parallel
    for param, kind in EXPECTED[name].items():
        assert result.kind_of(param) is kind, param
    for spec in result.replicated():
        assert spec.reason, f"{spec.name} is replicated without a reason"
    kinds = Counter((b.layer, b.kind) for b in result.blocks)
    assert kinds[(0, BlockKind.ATTENTION)] == kinds[(1, BlockKind.ATTENTION)] == 1
    assert kinds[(0, BlockKind.MLP)] == kinds[(1, BlockKind.MLP)] == 1
    assert kinds[(None, BlockKind.LM_HEAD)] == kinds[(None, BlockKind.EMBEDDING)] == 1


@pytest.mark.parametrize("name", FIVE_MODELS)
def test_two_all_reduces_each_way_per_layer(name):
    _, program, _ = compile_tp(name, 2)
    per_layer = program.tensor_parallel.comm_per_layer()
    for layer in (0, 1):
        assert per_layer[layer]["forward"] == Counter({Comm.ALL_REDUCE: 2}), layer
        assert per_layer[layer]["backward"] == Counter({Comm.ALL_REDUCE: 2}), layer
    # Embedding g; vocab-parallel cross-entropy: MAX, SUM, SUM; f before the LM head.
    assert per_layer[None]["forward"] == Counter({Comm.ALL_REDUCE: 4})
    assert per_layer[None]["backward"] == Counter({Comm.ALL_REDUCE: 1})


def test_fused_qkv_layouts_decoded():
    # GPT-2's Conv1D c_attn is (in, out) = [q|k|v]: rank 0 holds its heads of each, 3 ranges.
    result = compile_tp("hf:gpt2", 2)[1].tensor_parallel
    spec = result.specs["transformer.h.0.attn.c_attn.weight"]
    assert spec.dim == 1 and spec.local_shape == (64, 96)
    assert spec.ranges == (((0, 32), (64, 96), (128, 160)), ((32, 64), (96, 128), (160, 192)))
    # GPT-NeoX interleaves per head [q_h k_h v_h]: rank 0's two heads are rows 0..95.
    result = compile_tp("hf:gpt_neox", 2)[1].tensor_parallel
    assert result.specs["gpt_neox.layers.0.attention.query_key_value.weight"].ranges == (
        ((0, 96),), ((96, 192),))
    # ... and at tp=4 with the head dim still 48 wide per head triple.
    result = compile_tp("hf:gpt_neox", 4)[1].tensor_parallel
    assert result.specs["gpt_neox.layers.0.attention.query_key_value.weight"].ranges[3] == ((144, 192),)


def test_gqa_kv_heads_split_or_replicated():
    split = compile_tp("hf:llama", 2)[1].tensor_parallel
    assert split.specs["model.layers.0.self_attn.k_proj.weight"].ranges == (((0, 16),), ((16, 32),))
    assert any("kv heads 2 split" in b.detail for b in split.blocks)
    rep = compile_tp("hf:llama", 4)[1].tensor_parallel
    spec = rep.specs["model.layers.0.self_attn.k_proj.weight"]
    assert spec.kind is REP and "GQA" in spec.reason and "tp=4" in spec.reason
    # Each rank narrows k and v to its query heads: an all-gather of their gradients.
    assert rep.comm_per_layer()[0]["backward"] == Counter({Comm.ALL_REDUCE: 2, Comm.ALL_GATHER: 2})


def test_sequence_parallel_collectives():
    result = compile_tp("gpt-tiny", 2, sp=True)[1].tensor_parallel
    assert result.sequence_dim == 1
    layer = result.comm_per_layer()[0]
    assert layer["forward"] == Counter({Comm.ALL_GATHER: 2, Comm.REDUCE_SCATTER: 2})
    # Backward: the transposes, plus the per-shard gradients of the replicated norm
    # weights/biases (4) and row-parallel biases (2) all-reduced over the TP group.
    assert layer["backward"] == Counter({Comm.REDUCE_SCATTER: 2, Comm.ALL_GATHER: 2, Comm.ALL_REDUCE: 6})


def test_report_lists_everything():
    _, program, _ = compile_tp("hf:llama", 4)
    result = program.tensor_parallel
    text = render_sharding_report(result)
    assert "tp=4" in text and "vocabulary 128 -> padded 128 (32 rows per rank)" in text
    for spec in result.specs.values():
        assert spec.name in text
    assert "layer 0        attention heads 4 (1/rank), kv heads 2 replicated" in text
    assert "ffn 160 (40/rank)" in text
    assert "collectives per layer" in text
