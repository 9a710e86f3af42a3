"""Vocabulary passes with the embedding looked up by its rows' owners under GPipe and many
microbatches: a rank contributing to REDUCE_G goes on without waiting for the root (as the
schedule's simulation, which orders the lookups, has it). Waiting deadlocked here: the
root waited for that rank's lookup gradient of an earlier microbatch, which the rank
sends only after its own backward, queued behind the reduce."""
import pytest
import torch

from tests.runtime._dist import run_world

M = 8


def _gpipe_vocab(rank, world):
    from fxpipe.models.registry import build_workload
    from fxpipe.parallel import parallelize

    w = build_workload("gpt-tiny", batch=M, seq=64, seed=0)
    pm = parallelize(w.model, pp=2, dp=1, microbatches=M, schedule="gpipe", vocab_passes=True,
                     example_inputs=w.example_inputs, loss_fn=w.loss_fn, costs="model", partition="dp",
                     timeout_s=30)
    looked_up = sorted({lk.table for lk in pm.plan.lookups})
    losses = [pm.train_step(w.example_inputs) for _ in range(2)]
    pm.close()
    return looked_up, losses


@pytest.mark.slow
def test_gpipe_vocab_passes_with_eight_microbatches_equal_one_process():
    from fxpipe.models.registry import build_workload

    ranks = run_world(2, _gpipe_vocab)
    assert ranks[0][0], "the embedding is looked up by its rows' owners (the case that deadlocked)"
    w = build_workload("gpt-tiny", batch=M, seq=64, seed=0)
    assert w.loss_fn is None  # the model returns its loss
    expected = [w.model(*w.example_inputs).item()] * 2  # no optimizer step between them
    for _, losses in ranks:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
