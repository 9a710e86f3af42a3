"""The vocabulary rows each pipeline rank owns (passes/vocab_rows.py, sharding.PipelineRows).

In process: the compiled plan of the wide-vocabulary model (its LM head cut into blocks
over the stages), the rank specs composed with a tensor-parallel vocabulary shard, the
per-range tied-gradient segments and the rows a checkpoint writes per rank. Equality
with one process is checked in the equivalence worlds (tests/runtime/test_equivalence.py).
"""
import pytest
import torch

from fxpipe.compiler.pipeline import compile_pipeline
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.checkpoint.shard_chunks import first_held, restrict
from fxpipe.ir.shard_spec import PipelineRows, ShardKind, ShardSpec, compose, shard_tensor
from tests.runtime import _wide_vocab
from tests.runtime._reuse_capture import captures_reused

aten = torch.ops.aten


@pytest.fixture(scope="module", autouse=True)
def _captured_once():
    """The wide model is compiled at pp=4 and at pp=2 on the same microbatch: the second
    compile copies the first's capture (tests/runtime/_reuse_capture.py)."""
    with captures_reused():
        yield


@pytest.fixture(scope="module")
def compiled():
    """The untied wide-vocabulary Llama at pp=4 (1F1B, blockwise loss, cost model; pp=2 and
    the tied model run in the equivalence worlds)."""
    model, batch, loss_fn = _wide_vocab.workload()
    out = {}
    for pp in (4,):
        config = ParallelConfig(pp=pp, microbatches=4, costs="model", split_loss=True).with_world(pp)
        out[pp] = compile_pipeline(model, tuple(t[:2] for t in batch), config, loss_fn=loss_fn)
    return out


@pytest.mark.parametrize("pp", [4])
def test_each_stage_reads_only_its_rows(compiled, pp):
    c = compiled[pp]
    plan = c.plan
    rows = plan.row_shards["lm_head.weight"]
    vocab, width = _wide_vocab.VOCAB, _wide_vocab.WIDTH
    held = [rows.positions(p) for p in range(pp)]
    # Untied: every row held exactly once over the ranks, so the ranks together hold one
    # copy of the head (before: every rank with a block held all V·h of it).
    assert sorted(i for h in held for i in h) == list(range(vocab))
    assert sum(c.rank_specs(p)["lm_head.weight"].local_shape[0] for p in range(pp) if held[p]) == vocab
    assert "lm_head.weight" not in plan.tied_stages  # nothing to all-reduce: no row is held twice
    assert [seg[2] for seg in rows.segments()] == [(p,) for p in range(pp) if held[p]]
    for stage in plan.stages:
        rank = c.schedule.stage_to_rank(stage.index)
        spec = c.rank_specs(rank).get("lm_head.weight")
        names = [n for n in stage.graph_module.graph.nodes if n.op == "placeholder"][:len(stage.params)]
        for node, name in zip(names, stage.params):
            if name != "lm_head.weight":
                continue
            # The stage graph's parameter is the rank's rows, and every read is a slice in them.
            assert tuple(node.meta["val"].shape) == tuple(spec.local_shape) == (len(held[rank]), width)
            for user in node.users:
                assert user.target is aten.slice.Tensor and user.args[1] == 0
                assert 0 <= user.args[2] < user.args[3] <= len(held[rank])


def test_compose_with_a_padded_vocabulary_shard():
    """tp=2 × pipeline rows: rank (pp p, tp t) holds its pipeline positions of tp rank t's
    shard, padding rows last; shard_tensor of the composed spec equals slicing the
    tensor-parallel shard by the pipeline positions."""
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)  # V=7, padded to 8 over tp=2
    tp = ShardSpec(name="w", kind=ShardKind.VOCAB, full_shape=(7, 3), local_shape=(4, 3), dim=0,
                   ranges=(((0, 4),), ((4, 7),)))
    rows = PipelineRows(name="w", rows=4, ranks=(((0, 1),), ((1, 4),)))
    for p in range(2):
        spec = compose(tp, rows, p, (7, 3))
        for t in range(2):
            expected = shard_tensor(full, tp, t)[rows.positions(p)]
            assert torch.equal(shard_tensor(full, spec, t), expected), (p, t)
    assert compose(tp, rows, 1, (7, 3)).ranges == (((1, 4),), ((5, 7),))  # tp rank 1 ends in one pad row
    only_pp = compose(None, rows, 1, (4, 3))
    assert only_pp.kind is ShardKind.ROWS and only_pp.local_shape == (3, 3)


def test_tied_rows_sum_per_range_and_are_written_once():
    """A tied table on rank 0 and head rows on ranks 1 and 2 (interleaved rows on 2)."""
    rows = PipelineRows(name="w", rows=10, ranks=(((0, 10),), ((2, 5),), ((5, 7), (8, 10))))
    assert rows.segments() == [(0, 2, (0,)), (2, 5, (0, 1)), (5, 7, (0, 2)), (7, 8, (0,)), (8, 10, (0, 2))]
    assert rows.offset(2, 8) == 2
    assert first_held(rows, 0) == list(range(10)) and first_held(rows, 1) == [] == first_held(rows, 2)
    untied = PipelineRows(name="w", rows=10, ranks=(((0, 4),), ((3, 10),)))
    assert first_held(untied, 1) == list(range(1, 7))  # row 3 is written by rank 0
    spec = restrict(compose(None, untied, 1, (10, 2)), first_held(untied, 1))
    assert spec.ranges == (((4, 10),),) and spec.local_shape == (6, 2)


def test_an_even_head_split_holds_an_even_share_of_rows():
    """The head's blocks cut in half between two stages (the ILP places rows for time;
    here the cut is chosen): each rank's head parameter is within 10% of V·h/S bytes."""
    from fxpipe.compiler.pipeline import compile_program, capture_for
    from fxpipe.passes.coalesce_blocks import coalesce_blocks_pass
    from fxpipe.passes.split import split_program
    from fxpipe.passes.vocab_rows import hold_vocab_rows

    model, batch, loss_fn = _wide_vocab.workload()
    config = ParallelConfig(pp=2, microbatches=4, costs="model", split_loss=True).with_world(2)
    mb = tuple(t[:2] for t in batch)
    program = compile_program(capture_for(model, mb, config, loss_fn), config, until="split_loss").program
    (split,), (loss,) = program.matmul_splits, program.loss_splits
    k = len(split.blocks)
    second = {n for i in range(k // 2, k) for n in (*split.blocks[i].nodes, *loss.blocks[i].nodes)}
    stages = {}
    for node in program.graph.nodes:  # stage 1: the second half's blocks and all they feed
        if node.op == "call_function":
            later = node.name in second or any(stages.get(a.name) == 1 for a in node.all_input_nodes)
            stages[node.name] = 1 if later else 0
    plan = split_program(coalesce_blocks_pass(program.replace(stages=stages)), num_stages=2)
    rows = hold_vocab_rows(plan, (0, 1), {}).row_shards["lm_head.weight"]
    even = _wide_vocab.VOCAB / 2
    for p in range(2):
        assert abs(rows.local_rows(p) - even) <= 0.1 * even, rows.ranks
    assert rows.ranks == (((0, split.blocks[k // 2].start),), ((split.blocks[k // 2].start, _wide_vocab.VOCAB),))
    # Under tp > 1 a head TP left whole (no spec) is not split by rows: its spec would need
    # one row set per TP rank.
    assert not hold_vocab_rows(plan, (0, 1), {}, tp=2).row_shards


def test_the_embedding_is_looked_up_by_its_rows_owners(compiled):
    """The untied embedding at pp=4: the consuming stage reads the lookup as an input and
    holds no row of the table, the rows are split evenly over the ranks, and the owners'
    masked lookups (runtime/lookup_exchange.py, without the collectives) sum to the one-process
    lookup, each part's backward building the gradient of its owner's rows only; each
    owner sends its part of microbatch j no later than the consumer's F of j wants it
    and takes its gradient after the consumer's backward of j, in one time order."""
    from types import SimpleNamespace

    from fxpipe.runtime.lookup_exchange import VocabLookups

    c = compiled[4]
    plan = c.plan
    (lk,) = plan.lookups
    rows = plan.row_shards[lk.table]
    quarter = _wide_vocab.VOCAB // 4
    assert lk.table == "model.embed_tokens.weight"
    assert rows.ranks == tuple(((p * quarter, (p + 1) * quarter),) for p in range(4))
    stage = plan.stages[lk.stage]
    assert stage.lookups == (lk.name,) and lk.table not in plan.stage_params(lk.stage)
    assert not any(n.target is aten.embedding.default and n.meta["val"].shape == lk.spec.shape
                   for n in stage.graph_module.graph.nodes)
    model, batch, _ = _wide_vocab.workload()
    table = model.get_parameter(lk.table).detach()
    tokens = batch[lk.batch_input][:2]
    assert tuple(lk.ids(tokens).shape) == tuple(tokens.shape)
    grad = torch.randn(lk.spec.shape, generator=torch.Generator().manual_seed(1))
    parts, row_grads = [], []
    for p in range(4):
        state = {lk.table: table[rows.positions(p)].clone().requires_grad_(True)}
        groups = SimpleNamespace(pp_rank=p, rank=p, pp_peer=lambda q: q)
        owner = VocabLookups(plan, c.actions, groups, state, torch.device("cpu"), transport=None)  # no transfer here
        owner.start([[tokens if i == lk.batch_input else None for i in range(lk.batch_input + 1)]])
        part = owner._part(owner.lookups[0], 0)
        part.backward(grad)
        parts.append(part.detach())
        row_grads.append(state[lk.table].grad)
    full = table.clone().requires_grad_(True)
    expected = torch.nn.functional.embedding(lk.ids(tokens), full)
    expected.backward(grad)
    assert torch.equal(sum(parts), expected.detach())
    torch.testing.assert_close(torch.cat(row_grads), full.grad, rtol=0, atol=1e-6)


def test_a_tied_table_the_head_reads_whole_is_held_by_the_head_only():
    """gpt-tiny at pp=2 (its head not cut into blocks): the last rank's head reads the tied
    table whole, so that rank looks the embedding up for the first, which holds none of
    the table, and no gradient is all-reduced between the pipeline ends."""
    from fxpipe.models import build_workload

    w = build_workload("gpt-tiny", batch=8, seq=16, layers=2, seed=0)
    config = ParallelConfig(pp=2, microbatches=4, costs="model").with_world(2)
    c = compile_pipeline(w.model, tuple(t[:2] for t in w.example_inputs), config, loss_fn=w.loss_fn)
    (lk,) = c.plan.lookups
    vocab = w.model.get_parameter(lk.table).shape[0]
    assert c.plan.row_shards[lk.table].ranks == ((), ((0, vocab),))
    assert c.schedule.stage_to_rank(lk.stage) == 0 and lk.table not in c.plan.stage_params(lk.stage)
    assert lk.table not in c.plan.rank_params(0, c.schedule.stages_of_rank(0))
    assert lk.table in c.plan.rank_params(1, c.schedule.stages_of_rank(1))
    assert lk.table not in c.plan.tied_stages


def test_only_plain_lookups_of_batch_ids_are_outlined():
    """Frequency-scaled gradients, ids computed from the table, or ids that are not a
    batch input through views stay in the stage."""
    import torch.fx as fx

    from fxpipe.passes.outline_lookups import lookup_of

    g = fx.Graph()
    table, ids, other = g.placeholder("table"), g.placeholder("ids"), g.placeholder("other")
    flat = g.call_function(aten.view.default, (ids, [-1]))
    plain = g.call_function(aten.embedding.default, (table, flat))
    padded = g.call_function(aten.embedding.default, (table, ids, 3))
    scaled = g.call_function(aten.embedding.default, (table, flat, -1, True))
    shifted = g.call_function(aten.embedding.default, (table, g.call_function(aten.add.Tensor, (ids, 1))))
    batch = {ids: 0, other: 1}
    assert lookup_of(plain, table, batch) == (0, [flat])
    assert lookup_of(padded, table, batch) == (0, [])
    assert lookup_of(scaled, table, batch) is None
    assert lookup_of(shifted, table, batch) is None
    assert lookup_of(plain, other, batch) is None  # not a lookup of that table


@pytest.mark.parametrize("kind, p, v", [("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2), ("zb-h1", 4, 1),
                                        ("zb-v", 2, 2), ("gpipe", 2, 1)])
def test_lookup_parts_follow_the_microbatches_in_flight(kind, p, v):
    """Where each owner sends its parts and takes their gradients (runtime/lookup_exchange.py)
    on the lowered schedules: every part is sent once, before its gradient, and an owner
    never holds more parts than the consuming stage's peak in flight (the simulator's)
    plus the ones sent ahead — with m = 8 microbatches, never all of them under 1F1B."""
    from types import SimpleNamespace

    from fxpipe.ir.stage_plan import LOOKUP_PARTS_AHEAD
    from fxpipe.runtime.lookup_exchange import _points
    from fxpipe.schedules import generate, lower, simulate

    m = 8
    actions = lower(generate(kind, p, m, v))
    lk = SimpleNamespace(consumer=0, owners=tuple(range(1, p)), plan=SimpleNamespace(stage=0))
    bound = simulate(actions).peak_in_flight[0]
    for me in range(1, p):
        points = _points(actions, [lk], me)
        held = peak = 0
        sent, taken = set(), set()
        for k in sorted(points):
            for what, _lk, j in points[k]:
                if what == "send":
                    assert j not in sent
                    sent.add(j)
                    held += 1
                else:
                    assert j in sent and j not in taken
                    taken.add(j)
                    held -= 1
                peak = max(peak, held)
        assert sent == taken == set(range(m))
        assert peak <= bound + LOOKUP_PARTS_AHEAD, (me, peak, bound)
        if kind in ("1f1b", "zb-h1"):
            assert peak < m
