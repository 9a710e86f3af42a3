"""Pipeline (× data) parallel training equals single-process training (gloo, fp32).

Workers are spawned once per world size and run every case in it, because
spawning and importing torch dominates on a 2-core machine.
"""
import pytest
import torch

from tests.runtime._cases import reference, train_cases
from tests.runtime._dist import run_world

MODELS = ["gpt-tiny", "hf:gpt2", "hf:llama"]
SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb-h1", None)]


def _cases(pp):
    cases = [dict(model=m, pp=pp, schedule=s, chunks=c) for m in MODELS for s, c in SCHEDULES]
    if pp == 2:  # activation recomputation must not change a single gradient
        cases += [dict(model="gpt-tiny", pp=2, schedule="1f1b", recompute="full"),
                  dict(model="hf:llama", pp=2, schedule="zb-h1", recompute="selective"),
                  dict(model="hf:gpt2", pp=2, schedule="interleaved", chunks=2, recompute="full")]
    return cases


def _id(c):
    return f"{c['model']}-pp{c['pp']}-{c['schedule']}" + (f"-{c['recompute']}" if "recompute" in c else "")


@pytest.fixture(scope="module")
def references():
    return {m: reference(m) for m in MODELS}


@pytest.fixture(scope="module")
def world2():
    return run_world(2, train_cases, _cases(2))


@pytest.fixture(scope="module")
def world4():
    dp_cases = [dict(model=m, pp=2, schedule="1f1b") for m in MODELS]
    return run_world(4, train_cases, _cases(4) + dp_cases)


def _check(results_by_rank, index, references):
    rank0 = results_by_rank[0][index]
    ref_losses, ref_params, ref_grads = references[rank0["case"]["model"]]
    for rank_results in results_by_rank:
        r = rank_results[index]
        # Every rank reports the same mean loss, equal to one process's.
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        # Activation memory: never more microbatches in flight than the schedule's peak.
        assert r["peak"] <= r["bound"]
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6)
    assert set(rank0["params"]) == set(ref_params)
    for name, p in rank0["params"].items():
        # Elementwise within 1e-5: AdamW turns round-off in a zero-mean gradient (the
        # key bias, whose true gradient is 0) into lr-sized steps, so purely
        # relative tolerances would test noise.
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_cases(2))),
                         ids=[_id(c) for c in _cases(2)])
def test_pp2(world2, references, index):
    _check(world2, index, references)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_cases(4)) + len(MODELS)),
                         ids=[_id(c) for c in _cases(4)]
                         + [f"{m}-dp2-pp2-1f1b" for m in MODELS])
def test_pp4_and_dp2(world4, references, index):
    _check(world4, index, references)
