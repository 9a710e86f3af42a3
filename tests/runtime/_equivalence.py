"""The equivalence worlds' cases and their check against one process (shared by
test_equivalence.py, the worlds of 2 and 8, and test_equivalence_world4*.py, the world
of 4's cases in two modules so that pytest-xdist runs the two worlds on both workers)."""
import functools

import pytest
import torch

from fxpipe.ir.stage_plan import LOOKUP_PARTS_AHEAD
from tests.runtime._cases import LR, STEPS, reference


MODELS = ["gpt-tiny", "hf:gpt2", "hf:llama"]
SHARED = "tests.runtime._shared_weights:workload"  # a weight applied in two stages
WIDE = "tests.runtime._wide_vocab:workload"  # an untied LM head cut into blocks over both stages
TIED = "tests.runtime._wide_vocab:workload_tied"  # the same, its head tied to the embedding (GPT-2)
TIED_ODD = "tests.runtime._wide_vocab:workload_tied_odd"  # tied, a vocabulary tp=2 does not divide
EXPERTS = "tests.runtime._ep_cases:workload"  # a dropless MoE with stacked experts run by grouped_mm
SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb-h1", None)]
# Models written outside transformers (fxpipe/models/zoo), each at tp=2 × pp=2 (in the world
# of 4), 1F1B: both passes on every model in one case (benchmarks/compat.py runs pp=2 and tp=2
# alone for every zoo model too).
ZOO_MODELS = ["zoo:swa-gpt", "zoo:moe", "zoo:autocast", "zoo:complex-rope", "zoo:llama3", "zoo:biased-head"]


def _zoo_cases(tp, pp):
    return [dict(model=m, pp=pp, tp=tp, schedule="1f1b") for m in ZOO_MODELS]


def schedule_cases(pp):
    cases = [dict(model=m, pp=pp, schedule=s, chunks=c) for m in MODELS for s, c in SCHEDULES]
    if pp == 2:  # activation recomputation must not change a single gradient
        cases += [dict(model="gpt-tiny", pp=2, schedule="1f1b", recompute="full"),
                  dict(model="hf:llama", pp=2, schedule="zb-h1", recompute="selective"),
                  dict(model="hf:gpt2", pp=2, schedule="interleaved", chunks=2, recompute="full")]
        # ZB-V: two stages per rank in a V, backward split into I and W.
        cases += [dict(model=m, pp=2, schedule="zb-v", chunks=2) for m in MODELS]
        # One Linear used in both stages: its two partial gradients must be summed.
        cases += [dict(model=SHARED, pp=2, schedule="1f1b")]
        # Its cross-entropy block by block too (split_loss): the fold crosses stages.
        # With it, each rank holds only its rows of the head (passes/vocab_rows.py), and the
        # embedding is looked up by the owners of its rows (passes/outline_lookups.py): split
        # evenly when untied, the head's rows when tied; the first rank holds only its rows.
        cases += [dict(model=WIDE, pp=2, schedule="1f1b", split_loss=True, rows=True),
                  dict(model=WIDE, pp=2, schedule="zb-h1"),
                  dict(model=TIED, pp=2, schedule="1f1b", split_loss=True, rows=True),
                  dict(model=TIED, pp=2, schedule="interleaved", chunks=2, split_loss=True, rows=True)]
        # The head run as vocabulary passes (vocab_passes): rank r owns block r of its rows
        # (and of the embedding, looked up by the owners); the loss is the online softmax of
        # the blocks' statistics and the hidden state's gradient the sum of the blocks'.
        cases += [dict(model=WIDE, pp=2, schedule="1f1b", vocab_passes=True, rows=True),
                  dict(model=TIED, pp=2, schedule="1f1b", vocab_passes=True, rows=True),
                  dict(model=TIED, pp=2, schedule="zb-v", chunks=2, vocab_passes=True, rows=True)]
        # A head as training code writes it: its bias split with the rows, a logit scale
        # applied to each block, the loss on a sliced sequence with -100 targets
        # (each form alone in process: tests/passes/test_vocab_head_forms.py).
        cases += [dict(model="zoo:biased-head", pp=2, schedule="1f1b", vocab_passes=True)]
        # The default path: costs measured on the ranks, the ILP on those.
        cases += [dict(model="hf:llama", pp=2, schedule="1f1b", costs="measure")]
    return cases


def _tp_cases():
    """Tensor parallelism on 4 real processes: tp=4 for two families, tp=2 × dp=2 for
    two (the dp reduction does not depend on the family), tp=2 × pp=2 with 1F1B for three
    and interleaved for one, and sequence parallelism (Llama). All five families at tp=2 and
    tp=4 are checked in one process with emulated collectives
    (tests/passes/tensor_parallel/test_tp_equivalence.py); these cases add gloo's."""
    cases = [dict(model=m, pp=1, tp=4, schedule="1f1b") for m in ("gpt-tiny", "hf:llama")]
    cases += [dict(model=m, pp=1, tp=2, schedule="1f1b") for m in ("gpt-tiny", "hf:llama")]
    cases += [dict(model=m, pp=2, tp=2, schedule="1f1b") for m in MODELS]
    cases += [dict(model="hf:llama", pp=2, tp=2, schedule="interleaved", chunks=2)]
    cases += [dict(model="hf:llama", pp=2, tp=2, sp=True, schedule="1f1b")]
    # Split backward under TP: the collectives' backward runs in I or W, in one order.
    cases += [dict(model="hf:gpt2", pp=2, tp=2, schedule="zb-h1")]
    # ... with every layer recomputed: each region reruns in I and again in W (its
    # collectives with it), W finishing from I's captured gradients (ir/recompute_region.py).
    cases += [dict(model="gpt-tiny", pp=2, tp=2, schedule="zb-h1", recompute="full")]
    return cases


def world4_cases():
    # pp=4: every schedule on gpt-tiny; one each for the other two (every schedule runs for
    # every model at pp=2): interleaved for GPT-2 (Conv1D, tied head), ZB-H1 for Llama.
    keep = {"gpt-tiny": {s for s, _ in SCHEDULES}, "hf:gpt2": {"interleaved"}, "hf:llama": {"zb-h1"}}
    pp4 = [c for c in schedule_cases(4) if c["schedule"] in keep[c["model"]]]
    # Head rows owned over four ranks, tied, zero-bubble; and tp=2 × pp=2 cut right before
    # the vocabulary-parallel head (the value sent is f's output: its gradient is partial).
    # Untied at pp=4 with 1F1B too, and tied at dp=2 × pp=2 (a lookup per replica).
    rows = [dict(model=TIED, pp=4, schedule="zb-h1", split_loss=True, rows=True),
            dict(model=WIDE, pp=4, schedule="1f1b", split_loss=True, rows=True),
            dict(model=TIED, pp=2, schedule="1f1b", split_loss=True),
            dict(model=WIDE, pp=2, tp=2, schedule="1f1b", split_loss=True),
            dict(model=TIED, pp=4, schedule="zb-h1", vocab_passes=True, rows=True),
            # dp=2 × pp=2: each replica's vocabulary passes on its own pp group, the blocks'
            # gradients averaged over the replicas; interleaved (two stages per rank).
            dict(model=WIDE, pp=2, schedule="interleaved", chunks=2, vocab_passes=True),
            # tp=2 × pp=2: each TP rank's rows split over the pipeline (the statistics reduced
            # over both groups); tied with a padded vocabulary, untied with zero-bubble, and
            # with sequence parallelism (the head's input gathered over the sequence).
            dict(model=TIED_ODD, pp=2, tp=2, schedule="1f1b", vocab_passes=True),
            dict(model=WIDE, pp=2, tp=2, schedule="zb-h1", vocab_passes=True),
            dict(model="hf:llama", pp=2, tp=2, sp=True, schedule="interleaved", chunks=2, vocab_passes=True)]
    # Expert parallelism over half the data-parallel ranks (dp=4, ep=2): the experts' gradients
    # summed over the two ranks holding the same experts (runtime/experts.py); and under a
    # pipeline (dp=2 × pp=2), the experts' stage dispatching in every microbatch's F and B.
    experts = [dict(model=EXPERTS, pp=1, ep=2, schedule="1f1b"), dict(model=EXPERTS, pp=2, ep=2, schedule="1f1b")]
    # dp=2 × pp=2: the gradient all-reduce over replicas does not depend on the family; in
    # ~10 KB buckets each reduced as soon as its last W (zero-bubble: B split) finished it.
    return pp4 + [dict(model="gpt-tiny", pp=2, schedule="zb-h1", bucket_mb=0.01)] + _tp_cases() \
        + _zoo_cases(2, 2) + rows + experts


def case_id(c):
    return (f"{c['model']}-tp{c.get('tp', 1)}-pp{c['pp']}-{c['schedule']}"
            + ("-sp" if c.get("sp") else "") + (f"-ep{c['ep']}" if "ep" in c else "")
            + (f"-{c['recompute']}" if "recompute" in c else "")
            + (f"-costs-{c['costs']}" if "costs" in c else "") + ("-split-loss" if c.get("split_loss") else "")
            + ("-vocab-passes" if c.get("vocab_passes") else ""))


def world4_part(part: int) -> list[int]:
    """Indices into ``world4_cases()`` of one of the two worlds of 4 (near equal CPU time
    each): 0, the cases of the three families (the pp=4 schedules, the dp buckets, tensor
    parallelism); 1, the zoo models, the wide-vocabulary heads and expert parallelism. A
    model is captured once per rank in each world it appears in: none appears in both."""
    return [i for i, c in enumerate(world4_cases()) if (c["model"] in MODELS) == (part == 0)]


@functools.lru_cache(maxsize=None)
def references(model: str):
    """One process's run of ``model`` (``_cases.reference``), computed once per pytest
    process for every module that checks it."""
    return reference(model)


def check(results_by_rank, index):
    rank0 = results_by_rank[0][index]
    for rank_results in results_by_rank:
        if "error" in rank_results[index]:
            pytest.fail(rank_results[index]["error"])
    ref_losses, ref_params, ref_grads = references(rank0["case"]["model"])
    bf16_rtol = _bf16_rtol(rank0["case"]["model"])
    largest = max(float(g.abs().max()) for g in ref_grads.values())
    # The first step's global gradient norm as clipping computes it (each parameter, tied
    # copy and row range counted once) equals torch's over the one-process gradients.
    ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()])))
    for rank_results in results_by_rank:
        r = rank_results[index]
        # Every rank reports the same mean loss, equal to one process's.
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-5 if bf16_rtol is None else bf16_rtol)
        # Activation memory: never more microbatches in flight than the schedule's peak.
        assert r["peak"] <= r["bound"]
        for name, g in r["grads"].items():
            if bf16_rtol is None:
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)
            else:  # bf16 regions: a few bf16 ulps (2^-8) of the tensor's scale, floored as in compat
                scale = max(float(ref_grads[name].abs().max()), 1e-3 * largest)
                torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=bf16_rtol * scale)
    case = rank0["case"]
    if case.get("tp", 1) > 1 and case["pp"] > 1 and not case.get("sp") and case["model"] in MODELS:
        # Scatter-gather is on by default and the residual stream qualifies (SC21 §4.1).
        assert rank0["scatter_gather"] and rank0["chunked"] > 0
    if case.get("rows") or case.get("vocab_passes"):
        # The head's rows are split over the ranks, and each rank holds exactly its rows
        # (of its tensor-parallel shard under tp > 1: the vocabulary padded to a multiple of tp).
        assert rank0["rows"], "no parameter had its rows split over pipeline ranks"
        tp = case.get("tp", 1)
        if case.get("vocab_passes"):  # rank r holds block r of the vocabulary, of every split table
            v, pp = -(-ref_params[next(iter(rank0["rows"]))].shape[0] // tp), case["pp"]
            blocks = tuple(((r * v // pp, (r + 1) * v // pp),) for r in range(pp))
            assert all(ranks == blocks for ranks in rank0["rows"].values()), rank0["rows"]
        for name, ranks in rank0["rows"].items():
            assert min(sum(b - a for a, b in held) for held in ranks) < ref_params[name].shape[0] // tp
        for rank_results in results_by_rank:
            r = rank_results[index]
            for name, shape in r["held"].items():
                assert shape[0] == sum(b - a for a, b in rank0["rows"][name][r["pp_rank"]]), (name, r["pp_rank"])
        # The embedding table is looked up by its rows' owners: the first rank, whose stage
        # reads the lookup, holds only its rows of it (before: the whole table).
        assert rank0["lookups"], "the embedding was not looked up by its rows' owners"
        # Each owner holds a microbatch's part of the lookup only while the consuming stage
        # (on rank 0) holds its activations, and two sent ahead: never the step's m parts
        # (runtime/lookup_exchange.py; at pp=2 with 1F1B that is 4 of 8).
        for rank_results in results_by_rank:
            assert rank_results[index]["lookup_peak"] <= rank0["bound"] + LOOKUP_PARTS_AHEAD, (rank_results[index]["lookup_peak"],
                                                                              rank0["bound"])
        for name in rank0["lookups"]:
            assert sum(b - a for a, b in rank0["rows"][name][0]) < ref_params[name].shape[0], name
            assert results_by_rank[0][index]["held"].get(name, (0,))[0] < ref_params[name].shape[0], name
    assert set(rank0["params"]) == set(ref_params)
    # Final parameters within 1e-5 relative, over the whole parameter vector. Per
    # element, AdamW normalises every gradient coordinate (m/sqrt(v)), so a coordinate
    # whose true gradient is ~0 (e.g. the key bias: softmax ignores it) moves by
    # lr-sized steps driven by round-off in either run; per-element relative checks
    # would test that noise. The gradients above are compared per element.
    # With bf16 regions the gradients agree to a bf16 ulp, not fp32 round-off, and AdamW
    # turns a small gradient's ulp into a visible step: the vector is held to a tenth of
    # the gradients' tolerance (measured: 1.2e-4 at tp=2) and an element to what two
    # AdamW runs can move apart at most (lr per step each).
    vector_rtol, element_atol = (1e-5, 1e-4) if bf16_rtol is None else (bf16_rtol / 10, 2 * STEPS * LR)
    diff = sum(float((p - ref_params[n]).double().pow(2).sum()) for n, p in rank0["params"].items())
    norm = sum(float(p.double().pow(2).sum()) for p in ref_params.values())
    assert (diff / norm) ** 0.5 <= vector_rtol
    for name, p in rank0["params"].items():
        torch.testing.assert_close(p, ref_params[name], rtol=0, atol=element_atol, msg=lambda m: f"{name}: {m}")


def _bf16_rtol(model):
    from fxpipe.models.zoo import ZOO

    return ZOO[model[4:]].bf16_rtol if model.startswith("zoo:") else None




def world4_module(part: int):
    """One half of the world of 4 as a test module's names: its cases, the module-scoped
    fixture that runs them in one world, and the test checking each case."""
    from tests.runtime._cases import train_cases
    from tests.runtime._dist import run_world

    cases = [world4_cases()[i] for i in world4_part(part)]

    @pytest.fixture(scope="module")
    def world4():
        return run_world(4, train_cases, cases)

    @pytest.mark.slow
    @pytest.mark.parametrize("index", range(len(cases)), ids=[case_id(c) for c in cases])
    def test_world4(world4, index):
        check(world4, index)

    return cases, world4, test_world4
