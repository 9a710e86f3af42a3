"""Shard specs: a full state dict round-trips through per-rank shards, and the
shards are exactly the rows/columns the specs name."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fxpipe.passes.tensor_parallel import ShardKind, ShardSpec, shard_state, unshard_state
from fxpipe.ir.shard_spec import ranges_of
from tests.passes.tensor_parallel._tp_helpers import compile_tp


@pytest.mark.parametrize("name,tp", [("hf:gpt2", 2), ("hf:gpt2", 4), ("hf:llama", 4), ("gpt-tiny", 2)])
def test_round_trip(name, tp):
    base, program, _ = compile_tp(name, tp)
    specs = program.tensor_parallel.specs
    shards = [shard_state(base.state, specs, r) for r in range(tp)]
    for p in program.params:  # every rank's shard has the shape the graph expects
        assert all(tuple(s[p.canonical].shape) == p.shape for s in shards), p.name
    back = unshard_state(shards, specs)
    assert back.keys() == base.state.keys()
    for k, v in base.state.items():
        assert torch.equal(back[k], v), k


def test_non_contiguous_rows_are_the_named_ones():
    base, program, _ = compile_tp("hf:gpt2", 2)
    spec = program.tensor_parallel.specs["transformer.h.0.attn.c_attn.weight"]
    full = base.state["transformer.h.0.attn.c_attn.weight"]
    shard = shard_state(base.state, {spec.name: spec}, 1)[spec.name]
    assert torch.equal(shard, full[:, spec.indices(1)])


def test_program_keeps_full_state_and_local_shapes():
    base, program, _ = compile_tp("hf:llama", 2)
    assert program.state is base.state or dict(program.state) == dict(base.state)
    q = program.param("model.layers.0.self_attn.q_proj.weight")
    assert q.shape == (32, 64) and base.param(q.name).shape == (64, 64)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), tp=st.integers(1, 6), cols=st.integers(1, 3))
def test_vocab_padding_round_trip(rows, tp, cols):
    block = -(-rows // tp)
    ranges = tuple(ranges_of(range(r * block, min((r + 1) * block, rows))) for r in range(tp))
    spec = ShardSpec("w", ShardKind.VOCAB, (rows, cols), (block, cols), 0, ranges)
    full = torch.randn(rows, cols)
    shards = [shard_state({"w": full}, {"w": spec}, r) for r in range(tp)]
    assert all(s["w"].shape == (block, cols) for s in shards)
    assert all(torch.all(s["w"][len(spec.indices(r)):] == 0) for r, s in enumerate(shards))
    assert torch.equal(unshard_state(shards, {"w": spec})["w"], full)


@given(st.lists(st.integers(0, 50), unique=True))
def test_ranges_of(indices):
    indices = sorted(indices)
    assert [i for a, b in ranges_of(indices) for i in range(a, b)] == indices


def test_unshard_needs_every_rank():
    spec = ShardSpec("w", ShardKind.ROW, (2, 4), (2, 2), 1, (((0, 2),), ((2, 4),)))
    with pytest.raises(ValueError, match="tp=2"):
        unshard_state([{"w": torch.zeros(2, 2)}], {"w": spec})
