"""Shared by the tensor-parallel tests: captured programs (cached) and TP runs in emulation."""
from __future__ import annotations

import functools

import pytest
import torch

import fxpipe
from fxpipe.models import build_workload
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.tensor_parallel import (ShardKind, TPConfig, shard_state, tensor_parallel_pass,
                                           unshard_state)
from fxpipe.ir.program import Program
from fxpipe.tp import run_emulated, tp_group_context


@functools.lru_cache(maxsize=None)
def captured(name: str, **kw) -> tuple[Program, tuple[torch.Tensor, ...]]:
    """A canonicalized capture of a named workload (passes never mutate it: safe to share)."""
    w = build_workload(name, **kw)
    return canonicalize_pass(fxpipe.capture(w.model, w.example_inputs, w.loss_fn)), w.example_inputs


def leaves(state) -> dict[str, torch.Tensor]:
    """Fresh autograd leaves (every rank thread needs its own: replicated entries are shared)."""
    return {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in state.items()}


def reference(program: Program, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    state = leaves(program.state)
    loss = program.run(state, *batch)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in state.items() if v.grad is not None}


def run_tp(program: Program, full_state, batch, tp: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Every TP rank's graph in its own thread: per-rank losses and the full gradients.

    Replicated parameters must get the same gradient on every rank (checked here)."""
    specs = program.tensor_parallel.specs

    def step(group):
        state = leaves(shard_state(full_state, specs, group.rank))
        with tp_group_context(group):
            loss = program.run(state, *batch)
        loss.backward()
        return loss.detach(), {k: v.grad for k, v in state.items() if v.grad is not None}

    out = run_emulated(tp, step)
    for spec in specs.values():
        if spec.kind is ShardKind.REPLICATED and spec.name in out[0][1]:
            for rank in range(1, tp):
                assert torch.allclose(out[rank][1][spec.name], out[0][1][spec.name], atol=1e-6), \
                    f"replicated {spec.name}: rank {rank}'s gradient differs from rank 0's"
    return [o[0] for o in out], unshard_state([o[1] for o in out], specs)


def compile_tp(name: str, tp: int, sp: bool = False, **kw) -> tuple[Program, Program, tuple]:
    base, batch = captured(name, **kw)
    return base, tensor_parallel_pass(base, TPConfig(tp=tp, sp=sp)), batch


def token_batch(vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of token ids drawn after ``torch.manual_seed(0)`` and their next-token targets."""
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (2, seq))
    return ids, ids.roll(-1, 1)


def capture_models(models: dict, vocab: int, seq: int, model_seed: int | None = None) -> dict:
    """name -> (canonicalized capture, batch) for each ``models`` factory, all on one
    ``token_batch`` (``model_seed``: reseeded before each model is built, so its weights
    do not depend on the models before it)."""
    batch = token_batch(vocab, seq)
    out = {}
    for name, make in models.items():
        if model_seed is not None:
            torch.manual_seed(model_seed)
        out[name] = (canonicalize_pass(fxpipe.capture(make(), batch)), batch)
    return out


ATOL = 1e-5


def check_tp(base, program, batch, tp):
    """Every rank's loss and every gradient at ``tp`` equal one process's, to ``ATOL``."""
    ref_loss, ref_grads = reference(base, batch)
    losses, grads = run_tp(program, base.state, batch, tp)
    for rank, loss in enumerate(losses):
        assert loss.item() == pytest.approx(ref_loss.item(), abs=ATOL), f"rank {rank}"
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert grads[name].shape == g.shape, name
        err = (grads[name] - g).abs().max().item()
        assert err < ATOL, f"{name}: max gradient error {err}"
