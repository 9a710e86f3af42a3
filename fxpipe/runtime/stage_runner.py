"""Run one pipeline stage's forward and backward for one microbatch at a time.

Independent of transport: received tensors come in as a dict, produced tensors and
input gradients go out as dicts. The executor moves them between ranks (or hands
them over locally when two stages share a rank).

Memory: a microbatch's saved state (its input leaves and outputs, and through them
the autograd graph) is kept from its forward until its backward has consumed it,
then dropped — never longer (``in_flight`` counts them; the executor asserts the
schedule's peak).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Mapping, Sequence

import torch

from fxpipe.ir.stage_plan import PipelinePlan, Stage
from fxpipe.base.backward_split import BackwardSplit
from fxpipe.runtime.compiled_split import accumulate, compiled_node


@dataclass
class _Saved:
    inputs: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]
    split: BackwardSplit | None = None
    """Kept between the input-gradient (I) and weight-gradient (W) halves."""
    weights: tuple | None = None
    """A compiled stage's W instead: (its compiled backward node, the queued W graphs)."""


@dataclass
class StageRunner:
    """Forward/backward of ``stage`` with parameters from ``state`` (canonical name -> leaf)."""
    plan: PipelinePlan
    stage: Stage
    state: Mapping[str, torch.Tensor]
    loss_scale: float = 1.0
    """Each microbatch's loss is multiplied by this (1/num_microbatches) so the
    accumulated gradients equal the full-batch gradient."""
    context: Callable[[], ContextManager] = contextlib.nullcontext
    """Entered around every forward and every backward (B, I and W): the graph's
    collectives resolve their tensor-parallel group from it, and recomputed regions
    rerun forward ops (collectives, dropout from its RNG streams) inside backward."""
    compiled: Callable | None = None
    """The stage compiled by Inductor (``parallelize(inductor=True)``); None: the GraphModule.
    Either way the outputs carry an ordinary autograd graph."""
    saved: dict[int, _Saved] = field(default_factory=dict)
    peak_in_flight: int = 0
    losses: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._canonical = self.plan.canonical
        names = self.plan.stage_params(self.stage.index)
        self.params = [self.state[n] for n in names if self.state[n].requires_grad]

    @property
    def in_flight(self) -> int:
        return len(self.saved)

    def forward(self, mb: int, batch: Sequence[torch.Tensor],
                received: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the forward; return the tensors to send, by value name."""
        inputs = {}
        for name in self.stage.inputs:
            t = received[name]
            if self.plan.values[name].requires_grad:
                t = t.detach().requires_grad_(True)
            inputs[name] = t
        for name in self.stage.lookups:  # a table's lookup summed from its rows' owners
            inputs[name] = received[name].detach().requires_grad_(True)
        with torch.enable_grad(), self.context():
            out = self.stage.call(self.state, self._canonical, batch, inputs, self.compiled)
        n_sent = len(self.stage.outputs)
        sends = dict(zip(self.stage.outputs, out[:n_sent]))
        with torch.no_grad():  # buffers the forward writes, as the eager forward would
            for name, new in zip(self.stage.buffer_updates, out[n_sent:]):
                self.state[self._canonical[name]].copy_(new)
        if self.stage.is_last and self.plan.vocab_head is None:
            loss = out[-1]
            self.losses[mb] = float(loss.detach())
            outputs: tuple[torch.Tensor, ...] = (loss * self.loss_scale,)
        else:
            outputs = tuple(sends[n] for n in self.stage.outputs)
            if self.plan.vocab_head is not None:
                # A last stage left with nothing after the head's cut returns its input leaf:
                # a view gives it a grad_fn, which the zero-bubble split starts from.
                with torch.enable_grad():
                    outputs = tuple(t.view_as(t) if t.requires_grad and t.grad_fn is None else t for t in outputs)
        self.saved[mb] = _Saved(inputs, outputs)
        self.peak_in_flight = max(self.peak_in_flight, len(self.saved))
        return {n: t.detach() for n, t in sends.items()}

    def _grad_pairs(self, mb: int, grads: Mapping[str, torch.Tensor]):
        saved = self.saved[mb]
        if self.stage.is_last and self.plan.vocab_head is None:
            return saved, list(saved.outputs), [None]
        outs, gouts = [], []
        for name, t in zip(self.stage.outputs, saved.outputs):
            g = grads.get(name)
            if g is not None and t.requires_grad:
                outs.append(t)
                gouts.append(g)
        return saved, outs, gouts

    def _input_grads(self, saved: _Saved) -> dict[str, torch.Tensor]:
        return {n: t.grad for n, t in saved.inputs.items() if t.requires_grad and t.grad is not None}

    def backward(self, mb: int, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full backward (B): accumulate parameter gradients, return input gradients."""
        saved, outs, gouts = self._grad_pairs(mb, grads)
        if outs:
            with self.context():  # recomputed regions re-run forward ops in backward
                torch.autograd.backward(outs, gouts)
        del self.saved[mb]
        return self._input_grads(saved)

    def backward_input(self, mb: int, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Input-gradient half (I) of the zero-bubble split (Qi et al. 2024): only the
        gradients the previous stage waits for; the weight-gradient work is left in
        the graph for W (``backward_split.py``)."""
        saved, outs, gouts = self._grad_pairs(mb, grads)
        names = [n for n, t in saved.inputs.items() if t.requires_grad]
        queue = getattr(self.compiled, "weights", None)
        if queue is not None and names and outs:
            return self._compiled_input(saved, outs, gouts, names, queue)
        saved.split = BackwardSplit(outs, gouts, [saved.inputs[n] for n in names], self.params)
        with self.context():  # recomputed regions re-run forward ops in backward
            got = saved.split.backward_input()
        return {n: g for n, g in zip(names, got) if g is not None}

    def _compiled_input(self, saved: _Saved, outs, gouts, names, queue) -> dict[str, torch.Tensor]:
        """I of a stage whose compiled backward is split (``compiled_split.py``): the
        engine runs the compiled I graph, which queues the W graph instead of running it."""
        node = compiled_node(outs)
        wanted = [saved.inputs[n] for n in names]
        with self.context(), queue.defer():  # recomputed regions and collectives run in I
            got = torch.autograd.grad(outs, wanted, gouts, allow_unused=True)
        saved.weights = (node, queue.take())
        # One W per microbatch: none would mean the parameters' gradients were dropped.
        assert len(saved.weights[1]) == 1, f"{len(saved.weights[1])} weight halves queued by one I"
        return {n: g for n, g in zip(names, got) if g is not None}

    def backward_weight(self, mb: int) -> None:
        """Weight-gradient half (W): accumulate parameter gradients, free the microbatch.
        Runs only what I left owed, never the input-gradient work again."""
        saved = self.saved.pop(mb)
        if saved.weights is not None:
            node, pending = saved.weights
            with self.context():
                for weight in pending:  # one compiled W graph per microbatch
                    accumulate(node, weight())
            return
        assert saved.split is not None, f"W of microbatch {mb} before its I"
        with self.context():
            saved.split.backward_weight()
