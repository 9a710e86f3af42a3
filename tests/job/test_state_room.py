"""One comparison of training state with the memory it will have (``preflight_sizes.state_room``)
for both checks that use it: the bound from a config's sizes before any search, and the exact
count after the capture. Against closed forms, on this machine's CPUs with its free memory
and local ranks patched."""
from __future__ import annotations

import os

import pytest
import torch

from fxpipe.job import preflight_sizes
from fxpipe.job.preflight_files import PreflightError
from fxpipe.models.config_values import DeclaredShape

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU branch: free memory and local ranks")

GIB = 2**30


def _free(monkeypatch, nbytes: int) -> None:
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": nbytes // 4096, "SC_PAGE_SIZE": 4096}.get(
        name) or real(name))


@pytest.mark.parametrize("total, shards, ranks, local, need", [
    (8 * GIB, 4, 8, None, 16 * GIB),  # fxpipe starts all 8 here: a quarter each, the model twice (dp 2)
    (8 * GIB, 4, 8, "2", 4 * GIB),  # torchrun, 2 ranks on this node
    (8 * GIB, 8, 8, "16", 8 * GIB),  # never more local ranks than ranks
])
def test_the_state_on_this_machine_is_every_local_ranks_share(monkeypatch, total, shards, ranks, local, need):
    _free(monkeypatch, 100 * GIB)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    got, have, where = preflight_sizes.state_room(total, shards, ranks)
    assert (got, have) == (need, 100 * GIB) and where.startswith("the 100.0 GiB free on this machine"), where


def test_the_bound_refuses_exactly_past_the_free_memory(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    shape = DeclaredShape(layers=2, hidden=1024, vocab=32000, intermediate=4096)
    need = shape.min_params * preflight_sizes.STATE_BYTES_PER_PARAM  # all of it, over the ranks of this machine
    _free(monkeypatch, need + 4096)
    preflight_sizes.check_state_bound("m", shape, 4)
    _free(monkeypatch, need - 4096)
    with pytest.raises(PreflightError, match=rf"--model m has at least {shape.min_params:,} parameters .* spread over "
                                             rf"all 4 ranks\), more than the "):
        preflight_sizes.check_state_bound("m", shape, 4)


def test_the_exact_check_counts_one_model_per_replica(monkeypatch):
    """tp·pp share one model; each of dp replicas holds another: 16 B × params × dp on this machine."""
    from fxpipe.ir.parallel_config import ParallelConfig
    from fxpipe.job.preflight import check_state_fits
    from fxpipe.models import build_workload
    from fxpipe.compiler.capture import capture

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    w = build_workload("gpt-tiny", batch=1, seq=8)
    program = capture(w.model, w.example_inputs, loss_fn=w.loss_fn)
    params = sum(p.numel() for p in w.model.parameters())
    layout = ParallelConfig(tp=1, pp=2, dp=3)
    _free(monkeypatch, 16 * params * 3 + 4096)
    check_state_fits(program, layout)
    _free(monkeypatch, 16 * params * 3 - 4096)
    with pytest.raises(PreflightError, match=rf"the model's {params:,} parameters need"):
        check_state_fits(program, layout)
