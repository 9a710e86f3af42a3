"""Tensor-parallel GPT programs for the recompute tests (test_recompute_*.py), and their
per-rank runs in emulation.

Every TP rank runs the same rewritten graph on its shard of the weights, in its own
thread (``run_emulated``), inside ``tp_group_context(group, DropoutRNG(seed, rank))``
around the forward *and* the backward: with full recompute, backward reruns the
layer's collectives and TP dropouts, which read the context (docs/tensor_parallel.md).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any, Mapping, Sequence

import torch

import fxpipe
from fxpipe.costs.saved_activations import measure_saved
from fxpipe.models import build_workload
from fxpipe.models.gpt import GPT, GPTConfig
from fxpipe.compiler.driver import run_passes
from fxpipe.passes.recompute import RecomputeMode, apply_recompute
from fxpipe.passes.tensor_parallel import TPConfig, shard_state
from fxpipe.ir.program import Program
from fxpipe.tp import DropoutRNG, run_emulated, tp_group_context


@lru_cache(maxsize=None)
def captured(name: str, seq: int, dropout: float, attn_dropout: bool, batch: int, layers: int
             ) -> tuple[Program, tuple[torch.Tensor, ...], GPTConfig]:
    """The capture of a named model (fxpipe's GPT with ``dropout``; an HF model as built)."""
    w = build_workload(name, batch=batch, seq=seq, layers=layers)
    model = w.model
    if dropout and w.config is not None:
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(w.config, dropout=dropout))
        if not attn_dropout:  # dropout on the residual branches only (the TP dropout op)
            for block in model.transformer.h:
                block.attn.dropout = 0.0
    # Passes never mutate their input: one capture serves every TP config.
    return fxpipe.capture(model, w.example_inputs, w.loss_fn), tuple(w.example_inputs), model.config


@lru_cache(maxsize=None)
def tp_program(name: str, seq: int, dropout: float, *, tp: int, sp: bool, attn_dropout: bool = True,
               batch: int = 2, layers: int = 2) -> tuple[Program, tuple[torch.Tensor, ...], GPTConfig]:
    """(TP program, batch, model config) of fxpipe's GPT, through the default pass list."""
    program, example, cfg = captured(name, seq, dropout, attn_dropout, batch, layers)
    prog, _ = run_passes(program, TPConfig(tp=tp, sp=sp))
    assert prog.tensor_parallel.config == TPConfig(tp=tp, sp=sp)
    return prog, example, cfg


def _local(prog: Program, rank: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """This rank's shard of the state as fresh leaves (replicated entries are shared
    between the rank threads otherwise), and the parameter arguments in graph order."""
    specs = prog.tensor_parallel.specs
    state = {k: v.detach().clone().requires_grad_(v.requires_grad)
             for k, v in shard_state(prog.state, specs, rank).items()}
    return state, [state[p.canonical] for p in prog.params]


def saved_bytes_per_rank(prog: Program, batch: Sequence[torch.Tensor], mode: RecomputeMode, *,
                         seed: int = 0) -> list[dict[int | None, int]]:
    """Per TP rank, layer -> bytes its forward saves for backward (``fxpipe.costs.saved_activations``),
    with ``mode`` applied to the TP program's graph."""
    tp = prog.tensor_parallel.config.tp
    gm = apply_recompute(prog.graph_module, prog.layers, mode)

    def step(group) -> dict[int | None, int]:
        _, params = _local(prog, group.rank)
        with tp_group_context(group, DropoutRNG(seed, group.rank)):
            # The counter's saved-tensor hooks and grad mode are thread-local: each
            # rank thread counts only its own graph.
            return dict(measure_saved(gm, [*params, *batch], prog.layers).by_layer)

    return run_emulated(tp, step)


def loss_and_grads_per_rank(prog: Program, batch: Sequence[torch.Tensor], gm: torch.fx.GraphModule, *,
                            seed: int = 0) -> list[tuple[torch.Tensor, Mapping[str, torch.Tensor]]]:
    """Per TP rank: (loss, local gradients) of one forward+backward of ``gm``."""
    tp = prog.tensor_parallel.config.tp

    def step(group) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        state, params = _local(prog, group.rank)
        with tp_group_context(group, DropoutRNG(seed, group.rank)):
            out: Any = gm(*params, *batch)
            loss = out[prog.loss_output] if isinstance(out, (tuple, list)) else out
            loss.backward()
        return loss.detach(), {k: v.grad for k, v in state.items() if v.grad is not None}

    return run_emulated(tp, step)
