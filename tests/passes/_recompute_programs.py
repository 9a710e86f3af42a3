"""Programs the recompute tests (test_recompute_*.py) rewrite, and their runs.

Each program is captured and compiled once per pytest process (``lru_cache``); the
fxpipe GPT programs at a named shape share their capture with the tensor-parallel ones
of ``_recompute_tp.py`` (the passes never mutate their input).
"""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

import fxpipe
from fxpipe.compiler.driver import run_passes
from fxpipe.models.losses import causal_lm_loss
from tests.passes._recompute_tp import captured

# Model, dropout: the loss, gradient, region and ordering checks run on each.
CASES = [("gpt-tiny", 0.0), ("gpt-tiny", 0.1), ("gpt-small", 0.1), ("hf:llama", 0.0), ("hf:gpt2-eager", 0.1)]


@lru_cache(maxsize=None)
def program(name: str, dropout: float = 0.0, batch: int = 2, seq: int = 32, layers: int = 2):
    """(Program, batch) for fxpipe's GPT at a named shape with ``dropout``, or an HF model."""
    prog, example, _ = captured(name, seq, dropout, True, batch, layers)
    prog, _ = run_passes(prog)
    return prog, example


@lru_cache(maxsize=None)
def hf_gpt2_eager():
    """HF GPT-2 with its unfused attention (matmul -> softmax -> dropout -> matmul)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.1, bos_token_id=0,
                                  eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (2, 32))
    prog, _ = run_passes(fxpipe.capture(model, (ids, ids.clone()), causal_lm_loss))
    return prog, (ids, ids.clone())


def case_program(name, dropout):
    return hf_gpt2_eager() if name == "hf:gpt2-eager" else program(name, dropout)


def fresh_args(prog, batch):
    """Fresh leaf copies of the state (so gradients do not mix between runs) + the batch."""
    state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in prog.state.items()}
    return state, [state[p.canonical] for p in prog.params] + list(batch)


def loss_and_grads(prog, batch, gm, seed=123):
    state, args = fresh_args(prog, batch)
    torch.manual_seed(seed)
    out = gm(*args)
    loss = out[prog.loss_output] if isinstance(out, (tuple, list)) else out
    loss.backward()
    return loss.detach(), {k: t.grad for k, t in state.items() if t.grad is not None}


def two_stage_plan(prog, cut_after: str):
    """``prog`` split in two stages right after the node named ``cut_after``."""
    from fxpipe.passes.split import split_program

    order = [n.name for n in prog.graph.nodes if n.op == "call_function"]
    cut = order.index(cut_after) + 1
    return split_program(prog, {n: int(i >= cut) for i, n in enumerate(order)}, num_stages=2)
