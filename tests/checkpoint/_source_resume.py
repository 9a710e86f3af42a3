"""Resume of every way a model arrives (run inside a spawned gloo world of 2): each
source is trained one step at pp=2 and saved, then loaded into a fresh model of
another init at dp=2 (another layout); the loss of one batch after the load must
equal the saving model's. Non-persistent buffers (a Llama's rotary tables) are
neither expected in the checkpoint nor lost by it. (The key sets a load checks do not
depend on the layout; loads into the saving layout are tests/checkpoint/test_checkpoint.py's.)"""
from __future__ import annotations

from pathlib import Path

import torch

from fxpipe.models import build_workload
from tests.runtime._reuse_capture import reusing_captures

BATCH, SEQ = 4, 16
# Microbatches of 2 rows in both layouts: a model is captured once per worker (the
# second layout reuses the capture, _reuse_capture.py).
LAYOUTS = (dict(pp=2, microbatches=2), dict(pp=1, dp=2, microbatches=1))


def _batch(w, step: int):
    if w.vocab_size is None:  # a user function states no vocabulary: its own example batch
        return w.example_inputs
    gen = torch.Generator().manual_seed(100 + step)
    return w.batch_from_tokens(torch.randint(0, w.vocab_size, (BATCH, SEQ + 1), generator=gen))


def _build(name: str, weights: str | None, seed: int, **layout):
    from fxpipe.models.hf_dir import is_model_dir
    from fxpipe.parallel import parallelize

    # As `fxpipe run` builds them (job/prepare.py): a model directory on the meta device,
    # its tensors read from ``weights`` or initialised shard by shard.
    device = "meta" if is_model_dir(name) else "cpu"
    w = build_workload(name, batch=BATCH, seq=SEQ, seed=seed, device=device)
    pm = parallelize(w.model, example_inputs=_batch(w, 0), loss_fn=w.loss_fn, weights=weights,
                     partition="uniform", **layout)
    return pm, w, torch.optim.AdamW(pm.parameters(), lr=1e-2)


@reusing_captures
def world_sources(rank: int, world: int, root: str, sources: list[tuple[str, str | None]]) -> list[list[float]]:
    """``sources``: (model name, weights directory or None). Returns, per name, the
    saving model's loss, then per other layout the loss after the load and before it."""
    from fxpipe.checkpoint.dcp import load_checkpoint, save_checkpoint

    out = []
    for i, (name, weights) in enumerate(sources):
        directory = Path(root) / f"ck{i}"
        pm, w, opt = _build(name, weights, 0, **LAYOUTS[0])
        pm.train_step(_batch(w, 1))
        opt.step()
        save_checkpoint(pm, opt, 1, directory)
        losses = [pm.train_step(_batch(w, 2))]
        for layout in LAYOUTS[1:]:
            pm, w, opt = _build(name, weights, 1, **layout)  # another init: the load must replace it
            fresh = pm.train_step(_batch(w, 2))
            load_checkpoint(pm, opt, directory)
            losses += [pm.train_step(_batch(w, 2)), fresh]
        out.append(losses)
    return out
