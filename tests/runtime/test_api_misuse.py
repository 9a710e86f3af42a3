"""The Python API refuses misuse clearly: ``parallelize`` names an argument of the wrong type, and
a ``ParallelModel`` used wrongly is refused on every rank while training goes on."""
from __future__ import annotations

import pytest



def _misuse(rank, world):
    import torch

    from fxpipe.models.registry import build_workload
    from fxpipe.parallel import parallelize

    w = build_workload("gpt-tiny", batch=4, seq=8)
    pm = parallelize(w.model, example_inputs=w.example_inputs, loss_fn=w.loss_fn, pp=2, microbatches=2,
                     costs="model", partition="dp")
    out = {}
    first = pm.train_step(w.example_inputs)
    for name, batch in (("float", tuple(t.float() for t in w.example_inputs)),
                        ("dict", {"ids": w.example_inputs[0]})):
        try:
            pm.train_step(batch)
        except TypeError as exc:
            out[name] = str(exc)
    # Rank 1 reverses its rows: same sums, different order; every rank refuses alike.
    mine = w.example_inputs if rank == 0 else tuple(t.flip(0) for t in w.example_inputs)
    try:
        pm.train_step(mine)
    except ValueError as exc:
        out["differ"] = str(exc)
    out["again"] = pm.train_step(w.example_inputs)
    pm.close()
    pm.close()  # twice: nothing
    try:
        pm.train_step(w.example_inputs)
    except RuntimeError as exc:
        out["closed"] = str(exc)
    out["first"] = first
    del torch
    return out


def test_parallelize_names_the_argument_of_the_wrong_type():
    import torch

    from fxpipe.models.registry import build_workload
    from fxpipe.parallel import parallelize

    w = build_workload("gpt-tiny", batch=4, seq=8)
    batch = w.example_inputs
    cases = [(dict(model=lambda x: x, example_inputs=batch), r"takes the model as a torch.nn.Module, got function"),
             (dict(model=w.model, example_inputs={"ids": batch[0]}), r"example_inputs must be a tensor or a non-empty"),
             (dict(model=w.model, example_inputs=tuple(t.to("meta") for t in batch)),
              r"example_inputs\[0\] is on the meta device"),
             (dict(model=w.model, example_inputs=batch, loss_fn=3), r"loss_fn must be callable"),
             (dict(model=w.model, example_inputs=batch, tp="2", pp=1), r"tp must be an integer, got '2' \(str\)"),
             (dict(model=w.model, example_inputs=batch, pp=2, microbatches=2.5),
              r"microbatches must be an integer, got 2.5 \(float\)")]
    for kwargs, message in cases:
        model = kwargs.pop("model")
        with pytest.raises(TypeError, match=message):
            parallelize(model, **kwargs)
    assert not torch.distributed.is_initialized()  # refused before joining any group


@pytest.mark.slow
def test_misuse_of_a_parallel_model_is_refused_on_every_rank_and_training_goes_on():
    from tests.runtime._dist import run_world

    ranks = run_world(2, _misuse)
    for r in ranks:
        assert "batch tensor 0 has dtype torch.float32, the example batch's has torch.int64" in r["float"]
        assert "takes the batch as a tensor or a tuple of tensors" in r["dict"]
        assert ("the ranks of data-parallel replica 0 passed 2 different batches (ranks 0 one batch; ranks 1 one "
                "batch)") in r["differ"]
        assert "train_step after close()" in r["closed"]
        # No optimizer step between: a step after the refusals gives the first step's loss again.
        assert r["again"] == pytest.approx(r["first"], rel=1e-6)
    assert ranks[0]["again"] == ranks[1]["again"]
