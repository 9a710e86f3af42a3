"""Pipeline (× data) parallel training equals single-process training (gloo, fp32).

Workers start once per world and run every case in it; each model is captured once
per worker (``_reuse_capture.py``), as torch.export dominates a tiny case. The cases and
their check are in ``_equivalence.py``; the worlds of 2 and 8 run here, the world of 4's
cases in test_equivalence_world4.py and test_equivalence_world4_heads.py.
"""
import pytest

from tests.runtime._cases import train_cases
from tests.runtime._dist import run_world
from tests.runtime._equivalence import case_id, check, schedule_cases

WORLD8 = [dict(model="gpt-tiny", pp=2, tp=2, schedule="1f1b"),
          dict(model="gpt-tiny", pp=2, tp=2, schedule="interleaved", chunks=2)]


@pytest.fixture(scope="module")
def world2():
    return run_world(2, train_cases, schedule_cases(2))


@pytest.fixture(scope="module")
def world8():
    return run_world(8, train_cases, WORLD8)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(schedule_cases(2))), ids=[case_id(c) for c in schedule_cases(2)])
def test_pp2(world2, index):
    check(world2, index)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(2), ids=["tp2-pp2-dp2-1f1b", "tp2-pp2-dp2-interleaved"])
def test_world8_tp_pp_dp(world8, index):
    check(world8, index)
