"""Two processes, a real gloo ProcessGroup: the TP graph's loss and gradients equal
one process's (the emulation is not what makes the other tests pass)."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fxpipe.passes.tensor_parallel import TPConfig, shard_state, tensor_parallel_pass, unshard_state
from fxpipe.tp import ProcessGroupTP, tp_group_context
from tests.tensor_parallel._tp_helpers import captured, leaves, reference

TP = 2


def _worker(rank: int, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=TP)
    try:
        base, batch = captured("gpt-tiny")
        program = tensor_parallel_pass(base, TPConfig(tp=TP))
        group = ProcessGroupTP()
        state = leaves(shard_state(base.state, program.extra["tensor_parallel"].specs, group.rank))
        with tp_group_context(group):
            loss = program.run(state, *batch)
        loss.backward()
        torch.save({"loss": loss.detach(), "grads": {k: v.grad for k, v in state.items()
                                                    if v.grad is not None}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_gloo_tp2_equals_one_process(tmp_path):
    mp.spawn(_worker, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=TP)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(TP)]
    base, batch = captured("gpt-tiny")
    ref_loss, ref_grads = reference(base, batch)
    specs = tensor_parallel_pass(base, TPConfig(tp=TP)).extra["tensor_parallel"].specs
    grads = unshard_state([r["grads"] for r in results], specs)
    for r in results:
        assert abs(r["loss"].item() - ref_loss.item()) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max().item() < 1e-5, name
