"""What the layout search prices with (fxpipe/costs/local.py, fxpipe/planner/captured.py,
fxpipe/job/layout_choice.py): a shard's compute timed in one process with collectives that
return the real shapes, the vocabulary passes' math against autograd's cross-entropy,
every node of any compile of the capture given a time, oversubscribed cores, the search
against a brute force over every layout, ``fxpipe run`` with no layout, and the planner's
shape read off a captured graph."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fxpipe.base.hardware import Collective, get_hardware
from fxpipe.compiler.context import CompileContext
from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.costs.local import measure_locally, node_times_for, time_vocab_passes
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.registry import GPT_CONFIGS, build_workload
from fxpipe.params.rank_state import ShardBuilder
from fxpipe.passes.assign_stages import build_problem_graph
from fxpipe.planner.auto_layout import search_layout
from fxpipe.planner.layout_space import PIPELINE_SCHEDULES
from fxpipe.planner.layout_price import price
from fxpipe.planner.captured import captured_shape
from fxpipe.planner.shapes import shape_from_registry
from fxpipe.runtime.head_blocks import block_gradient, block_statistics
from fxpipe.schedules.registry import ScheduleKind, get_spec
from fxpipe.tp import ShapesOnlyGroup, run_emulated


@pytest.fixture(scope="module")
def tiny():
    return build_workload("gpt-tiny", batch=8, seq=16)


def test_shapes_only_group_returns_what_a_real_group_returns_in_shape():
    t = torch.randn(4, 6)

    def real(group):
        return [tuple(x.shape) for x in (group.all_reduce(t), group.all_gather(t, 1), group.reduce_scatter(t, 0),
                                         group.all_gather(t, 0))]
    emulated = run_emulated(2, real)
    alone = ShapesOnlyGroup(2)
    assert real(alone) == emulated[0] == [(4, 6), (4, 12), (2, 6), (8, 6)]
    assert alone.rank == 0 and alone.size == 2
    torch.testing.assert_close(alone.reduce_scatter(t, 0), t[:2])  # this rank's chunk, from its own data


def test_block_math_is_the_cross_entropy_and_its_gradient():
    # One block holding the whole vocabulary: the statistics are the softmax's, the
    # gradient autograd's for a mean cross-entropy.
    torch.manual_seed(0)
    logits = torch.randn(12, 40, requires_grad=True)
    target = torch.randint(0, 40, (12,))
    stats = block_statistics(logits, target, 0, 0)
    loss = stats[0] + torch.log(stats[1]) - stats[2]
    torch.testing.assert_close(loss.mean(), F.cross_entropy(logits, target))
    F.cross_entropy(logits, target).backward()
    grad = block_gradient(logits, stats, target, 0, 0, torch.full((12,), 1 / 12))
    torch.testing.assert_close(grad, logits.grad)
    s, t = time_vocab_passes(64, 16, 128, repeats=2)
    assert s > 0 and t > 0


def test_measured_times_cover_every_node_of_any_compile_of_the_capture(tiny):
    config = ParallelConfig(tp=2, pp=2, dp=1, microbatches=2, schedule="1f1b", partition="dp", costs="model")
    program = capture_for(tiny.model, tuple(t[:4] for t in tiny.example_inputs), config, tiny.loss_fn)
    costed = compile_program(program, config, until="cost").program
    shards = ShardBuilder(costed, costed.tp_specs, tiny.model, tp_rank=0, device=torch.device("cpu"))
    pconfig = CompileContext.of(config).partition
    timed = measure_locally(costed, pconfig, tuple(t[:4] for t in tiny.example_inputs), shards.tensors, tp=2,
                            repeats=1)
    # tp rank 0's shards were built: half the heads' columns of every column-parallel matrix.
    assert any(s.shape != costed.state[n].shape for n, s in shards.tensors(list(shards.specs)).items())
    assert all(f >= 0 and b >= 0 for f, b in timed.fused.values()) and sum(f for f, _ in timed.fused.values()) > 0
    assert timed.scale[0] > 0 and timed.scale[1] > 0
    full = compile_program(program, config).program  # the pipeline's compile: split matmuls, two stages
    times = node_times_for(full, pconfig, timed, split_backward=False)
    assert set(times) == set(build_problem_graph(full, pconfig).nodes)
    shared = set(times) & set(timed.fused)
    assert shared and all(times[n] == timed.fused[n] for n in shared if not any(
        n in b.nodes for s in full.matmul_splits for b in s.blocks))


def test_oversubscribed_cores_price_every_ranks_compute(tiny):
    config = ParallelConfig(pp=2, dp=2, microbatches=1, schedule="gpipe", partition="dp", costs="model")
    program = capture_for(tiny.model, tuple(t[:4] for t in tiny.example_inputs), config, tiny.loss_fn)
    compiled = compile_program(program, config)
    own, shared = price(compiled), price(compiled, concurrent=1)
    stages = compiled.program.partition.stages
    # One core for four ranks: at least every rank's compute one after another.
    busy = sum(c.fwd_s + c.bwd_s for c in stages) * config.replicas
    assert shared.step_s >= busy and shared.step_s > own.step_s
    assert price(compiled, concurrent=4).step_s == own.step_s


def test_the_search_is_the_fastest_of_every_layout_priced_one_by_one(tiny):
    base = ParallelConfig(costs="model", hardware="cpu")
    batch = tuple(t[:4] for t in tiny.example_inputs)  # 4 rows: every layout of them, by hand
    found = search_layout(tiny.model, batch, 2, loss_fn=tiny.loss_fn, base=base, exhaustive=True)
    brute, programs, skipped = {}, {}, 0
    rows = batch[0].shape[0]
    for tp, pp, dp in ((1, 1, 2), (1, 2, 1), (2, 1, 1)):
        for m in (d for d in range(1, rows + 1) if (rows // dp) % d == 0):
            kinds = PIPELINE_SCHEDULES if pp > 1 else (ScheduleKind.ONE_F_ONE_B,)
            for kind in kinds:
                for vocab, blockwise in (((False, False), (True, False), (False, True)) if pp > 1
                                         else ((False, False),)):
                    config = dataclasses.replace(base, tp=tp, pp=pp, dp=dp, num_microbatches=m, schedule=kind,
                                                 chunks=get_spec(kind).default_chunks, vocab_passes=vocab,
                                                 split_loss=blockwise, partition="dp")
                    b = rows // (dp * m)
                    if b not in programs:
                        programs[b] = capture_for(tiny.model, tuple(t[:b] for t in batch), config, tiny.loss_fn)
                    compiled = compile_program(programs[b], config)
                    if blockwise and not compiled.program.loss_splits:
                        skipped += 1  # the head was not cut: the same layout as the whole head
                        continue
                    brute[(tp, pp, dp, m, kind, vocab, blockwise)] = price(compiled).step_s
    assert len(brute) + skipped == len(found.ranked) + len(found.refused)
    key = lambda c: (c.tp, c.pp, c.dp, c.num_microbatches, c.schedule, c.vocab_passes, c.split_loss)  # noqa: E731
    assert key(found.chosen.config) == min(brute, key=brute.get)
    for p in found.ranked:
        assert p.step_s == pytest.approx(brute[key(p.config)], rel=1e-9)


def test_the_search_on_measured_costs_times_each_shape_once(tiny):
    found = search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, base=ParallelConfig(),
                          threads=1)
    # (tp, micro-batch rows): tp=1 with 8, 4, 2, 1 rows (dp=1) and 4, 2, 1 (dp=2); tp=2 with 8, 4, 2, 1.
    assert "timed here at each layout's shard shapes (8 shapes, 1 thread(s))" in found.table()
    steps = [p.step_s for p in found.ranked]
    assert steps == sorted(steps) and len(found.ranked) + len(found.refused) + found.pruned == 67


def test_captured_shape_is_the_registry_shape_and_reads_other_models():
    for name in ("gpt-1.7b", "gpt-tiny"):
        got = captured_shape(name)
        # the captured GPT's own matrices are the registry GPT's; its SDPA call is priced as flash
        ref = dataclasses.replace(shape_from_registry(name), dropout=False, fused_attention=True)
        assert dataclasses.replace(got.shape, linears=None, layer_vector_params=None, ffn_hidden=None,
                                   kv_heads=None) == ref
        assert got.shape.layer_linears == ref.layer_linears
        assert got.graph_params == pytest.approx(got.shape.num_params, rel=1e-6) or GPT_CONFIGS[name].bias is False
        assert got.graph_flops == pytest.approx(got.formula_flops, rel=1e-3)
    llama = captured_shape("hf:llama")
    cfg = build_workload("hf:llama", batch=1).model.config
    assert (llama.shape.layers, llama.shape.hidden, llama.shape.heads, llama.shape.vocab) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size)


def test_fxpipe_plan_takes_a_model_directory(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from fxpipe.cli import main

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    assert main(["plan", "--model", str(tmp_path / "llama"), "--gpus", "4", "--global-batch", "8",
                 "--hardware", "cpu", "--seq", "64", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "l=3 h=64 a=4 s=64 V=512" in out and "searched" in out


@pytest.mark.slow
def test_fxpipe_run_without_a_layout_searches_it():
    res = subprocess.run([sys.executable, "-m", "fxpipe", "run", "--model", "gpt-tiny", "--world", "2", "--steps",
                          "1", "--seq", "16", "--timeline", "none", "--costs", "model", "--global-batch", "8"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "searching the layouts of 2 ranks" in out and "-> tp=" in out
    chosen = out.split("-> ", 1)[1].split()[:3]  # e.g. ['tp=1', 'pp=1', 'dp=2']
    ran = out.split("fxpipe run: gpt-tiny", 1)[1].splitlines()[0]
    assert " ".join(chosen) in ran.replace(" (sp)", ""), (chosen, ran)
    assert "done: loss" in out


def test_zero_1_is_tried_where_a_data_parallel_layout_does_not_fit(tiny):
    base = ParallelConfig(costs="model", hardware="cpu")
    found = search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, base=base, pinned={"dp": 2})
    plain = next(p for p in found.ranked if (p.config.dp, p.config.num_microbatches) == (2, 1))
    assert not plain.config.zero and "zero-1" not in found.table()  # no limit: nothing to shard
    limit = plain.memory_bytes - 1
    capped = search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, pinned={"dp": 2},
                           base=dataclasses.replace(base, memory_limit_gb=limit / 2**30))
    sharded = next(p for p in capped.ranked if (p.config.dp, p.config.num_microbatches) == (2, 1))
    assert sharded.config.zero == 1 and sharded.memory_bytes <= limit
    # Adam's two moments (8 of the 16 bytes per fp32 parameter) halved over dp = 2: the state
    # is 3/4 of what it was, the activations the same.
    params = plain.memory_bytes - sharded.memory_bytes
    # The reduce onto owners and the gather move the all-reduce's bytes (one bucket: all of
    # it after the backward); each owner steps half the parameters: 28 bytes of fp32 Adam
    # traffic each at the profile's memory bandwidth, and half the tensors, each at the
    # optimizer's fixed cost per tensor. The gather runs behind the next step's first
    # forward (runtime/param_waits.py): up to all of it is hidden.
    count = sum(p.numel() for p in tiny.model.parameters())
    hw = get_hardware("cpu")
    saved = count / 2 * 28 / hw.memory_bw + len(list(tiny.model.parameters())) / 2 * hw.optimizer_tensor_s
    gather = hw.collective_s(Collective.ALL_GATHER, 4 * count, 2, hw.members_per_node(2, 1))
    hidden = plain.step_s - saved - sharded.step_s
    assert params > 0 and 0 < hidden <= gather * (1 + 1e-9)
    assert any(name == "tp=1 pp=1 dp=2 m=1" and "over the limit" in why for name, why in capped.refused)


def test_cpu_processes_keep_freed_blocks_as_the_search_times_them():
    import platform

    from fxpipe.base import cpu_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    # Set once per process, by every CPU rank (runtime/launch.py) and by the search's timing.
    assert cpu_memory.keep_freed_blocks() is True and cpu_memory._done == [True]
    assert cpu_memory.keep_freed_blocks() is True and cpu_memory._done == [True]


def _run_layout(rank, world):
    from fxpipe.job.config import TrainConfig
    from fxpipe.job.layout_choice import choose_run_layout

    config = TrainConfig(model="gpt-tiny", seq=16, steps=1, global_batch=16, micro_batch_size=4,
                         parallel=ParallelConfig(tp=2, pp=2, dp=1, microbatches=4, costs="model"))
    chosen = choose_run_layout(config, world, {"pp": 2})
    return chosen.parallel, chosen.micro_batch_size, chosen.batch


@pytest.mark.slow
def test_under_torchrun_rank_0_chooses_the_runs_layout_for_every_rank():
    from tests.runtime._dist import run_world

    ranks = run_world(2, _run_layout)
    assert ranks[0] == ranks[1]  # one choice, every rank
    parallel, rows, batch = ranks[0]
    assert parallel.pp == 2 and parallel.tp * parallel.pp * parallel.dp == 2 and batch == 16
    assert rows * parallel.num_microbatches * parallel.dp == 16


def test_a_blockwise_loss_shares_the_timed_cost_of_the_loss_it_replaces():
    """The cross-entropy cut into blocks is priced by what the captured loss took when timed,
    shared over the blocks (by the cost model there were 19 small ops a block, many times
    the timed loss)."""
    from fxpipe.models.gpt import GPT, GPTConfig
    from fxpipe.models.workload import Workload

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=2, n_head=4, n_embd=32))
    ids = torch.randint(0, 4096, (2, 17))
    w = Workload(model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), None, None, vocab_size=4096)
    config = ParallelConfig(pp=2, microbatches=1, schedule="1f1b", partition="dp", costs="model", split_loss=True)
    program = capture_for(w.model, w.example_inputs, config, w.loss_fn)
    costed = compile_program(program, config, until="cost").program
    shards = ShardBuilder(costed, costed.tp_specs, w.model, tp_rank=0, device=torch.device("cpu"))
    pconfig = CompileContext.of(config).partition
    timed = measure_locally(costed, pconfig, w.example_inputs, shards.tensors, tp=1, repeats=1)
    full = compile_program(program, config, until="split_loss").program
    assert full.loss_splits and len(full.loss_splits[0].blocks) > 1
    loss = full.loss_splits[0]
    assert loss.replaced and all(n in timed.fused for n in loss.replaced if n in costed.costs)
    times = node_times_for(full, pconfig, timed, split_backward=False)
    blocks = [n for b in loss.blocks for n in b.nodes if n in times]
    for i in (0, 1):
        want = sum(timed.fused[n][i] for n in loss.replaced if n in timed.fused)
        assert want > 0
        assert sum(times[n][i] for n in blocks) == pytest.approx(want, rel=1e-9)
