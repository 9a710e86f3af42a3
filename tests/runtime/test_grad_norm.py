"""--grad-clip: the global gradient norm over tp/pp/dp shards (tied embeddings, ZeRO-1)
equals torch.nn.utils.clip_grad_norm_ on one process, and so do the clipped gradients."""
from __future__ import annotations

import pytest
import torch

from tests.runtime import _clip_cases as cases
from tests.runtime._dist import run_world


@pytest.fixture(scope="module")
def world4():
    return run_world(4, cases.world_clip)


@pytest.mark.slow
def test_clipping_over_shards_equals_one_process(world4):
    keys = sorted(world4[0])
    assert len(keys) == len(cases.LAYOUTS) + 1
    for key in keys:
        for rank_result in world4:
            r = rank_result[key]
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), key
            assert sorted(r["grads"]) == sorted(r["ref"]), key
            for name, g in r["grads"].items():
                torch.testing.assert_close(g, r["ref"][name], rtol=1e-4, atol=1e-6, msg=f"{key} {name}")
