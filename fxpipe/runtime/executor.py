"""Interpret one pipeline rank's lowered action list for one training step.

Every registered schedule is just a list of ``Action``s per rank (F, B, I, W,
SEND_F, RECV_F, SEND_B, RECV_B); the executor maps each kind to a method:

- F / B / I / W run the stage's ``StageRunner``;
- RECV_* post the receives of a stage's cross-rank inputs (or output gradients);
  the compute that needs them waits just before it runs;
- SEND_* post the sends of what a stage produced for other ranks;
- BCAST_H / S / ALLREDUCE_S / T / REDUCE_G run this rank's block of the LM head
  (``head_blocks.py``); REDUCE_G's sum is the last stage's output gradient.

Values between stages on the *same* rank (interleaved chunks, the turn of a V)
are handed over in memory, never sent. A value whose transfer the schedule does
not mention — a skip connection to a stage two or more hops away — is sent right
after it is computed and received just before it is needed (sends never block).
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.runtime.head_blocks import HeadBlock
from fxpipe.runtime.lookup_exchange import VocabLookups
from fxpipe.runtime.stage_runner import StageRunner
from fxpipe.runtime.transport import Transport, check_spec
from fxpipe.schedules.actions import Action, ActionKind
from fxpipe.schedules.schedule import Schedule

K = ActionKind
Key = tuple[int, int]  # (stage, microbatch)


class PipelineExecutor:
    def __init__(self, plan: PipelinePlan, schedule: Schedule, pp_rank: int,
                 runners: dict[int, StageRunner], transport: Transport,
                 global_rank_of_pp: Callable[[int], int], lookups: VocabLookups | None = None,
                 vocab: HeadBlock | None = None) -> None:
        self.plan, self.schedule, self.pp_rank = plan, schedule, pp_rank
        self.vocab = vocab
        """This rank's block of the LM head (``head_blocks.py``), with ``plan.vocab_head``."""
        self.lookups = lookups
        """The owners' embedding lookups of row-split tables (``lookup_exchange.py``): each
        owner's part of a microbatch sent before the action its simulation placed it at,
        summed by the consuming stage's rank, its gradient sent back after the backward."""
        self.runners, self.transport = runners, transport
        self.peer = global_rank_of_pp
        self.actions = schedule.actions[pp_rank]
        self.rank_of = schedule.stage_to_rank
        listed = {(a.kind, a.stage, a.microbatch) for a in self.actions}
        self._send_listed = listed
        self.peak_in_flight = 0
        self.events: list[tuple[Action, float, float]] = []
        self.before_forward: Callable[[], None] | None = None
        """Called once, before the step's first forward computes (after its inputs arrived):
        ZeRO-1's parameter broadcast is waited for here."""
        self.reduction: Any = None
        """``grad_buckets.OverlappedReduction``: told where each action starts and ends, so
        it arms its gradient hooks for the actions that finish gradients."""

    # ---- one step ----------------------------------------------------------------------
    def run(self, microbatches: Sequence[Sequence[torch.Tensor]]) -> None:
        self.mb = microbatches
        self.fwd_in: dict[Key, dict[str, torch.Tensor]] = defaultdict(dict)
        self.bwd_in: dict[Key, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self.to_send: dict[tuple[K, int, int], list[tuple[str, int, torch.Tensor]]] = {}
        self.posted: dict[tuple[K, int, int], list[tuple[Any, str, torch.Tensor]]] = {}
        self.events = []
        self.transport.waited_s = self.transport.posted_s = self.transport.posted_cpu_s = 0.0
        self.transport.posts = 0
        handlers = {K.F: self._forward, K.B: self._backward, K.I: self._backward,
                    K.W: self._weight, K.SEND_F: self._send, K.SEND_B: self._send,
                    K.RECV_F: lambda a: self._post_recv(a.stage, a.microbatch, backward=False),
                    K.RECV_B: lambda a: self._post_recv(a.stage, a.microbatch, backward=True),
                    K.BCAST_H: lambda a: self.vocab.bcast_h(a.microbatch),
                    K.S: lambda a: self.vocab.s(a.microbatch),
                    K.ALLREDUCE_S: lambda a: self.vocab.allreduce_s(a.microbatch),
                    K.T: lambda a: self.vocab.t(a.microbatch), K.REDUCE_G: self._reduce_g}
        if self.lookups is not None:
            if self.before_forward is not None:  # the owners look their rows up right away
                self.before_forward()
                self.before_forward = None
            self.lookups.start(microbatches)
        for index, action in enumerate(self.actions):
            if self.lookups is not None:
                self.lookups.before(index)
            self._compute_start = None
            start = time.perf_counter()
            if self.reduction is not None:
                self.reduction.before_action(index)
            handlers[action.kind](action)
            if self.reduction is not None:
                self.reduction.after_action(index)
            # A compute action's event starts after its receives arrived: waiting is bubble.
            self.events.append((action, self._compute_start or start, time.perf_counter()))
        if self.lookups is not None:
            self.lookups.finish(len(self.actions))
        if self.vocab is not None:
            self.vocab.finish()
        self.transport.flush_sends()
        if self.before_forward is not None:  # a rank without a forward still gets the parameters
            self.before_forward()
            self.before_forward = None
        assert not self.to_send and not self.posted, "every transfer of the step completed"
        assert self.vocab is None or self.vocab.idle, "every vocabulary pass of the step ran"
        leftover = {s: r.in_flight for s, r in self.runners.items() if r.in_flight}
        assert not leftover, f"activations still held after the step: {leftover}"

    # ---- compute -------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        self._post_recv(s, mb, backward=False)  # no-op if the schedule already posted them
        received = self.fwd_in.pop((s, mb), {})
        received.update(self._wait((K.RECV_F, s, mb)))
        if self.lookups is not None:
            received.update(self.lookups.inputs(s, mb))
        if self.before_forward is not None:
            self.before_forward()
            self.before_forward = None
        self._compute_start = time.perf_counter()
        outs = self.runners[s].forward(mb, self.mb[mb], received)
        head = self.plan.vocab_head
        if head is not None and s == self.plan.num_stages - 1:  # the head's input, for BCAST_H
            self.vocab.put(mb, tuple(outs.pop(n) for n in head.outputs))
        self.peak_in_flight = max(self.peak_in_flight, sum(r.in_flight for r in self.runners.values()))
        remote = []
        for name, t in outs.items():
            for c in self.plan.values[name].consumers:
                if self.rank_of(c) == self.pp_rank:
                    self.fwd_in[(c, mb)][name] = t
                else:
                    remote.append((name, c, t))
        self._queue((K.SEND_F, s, mb), remote)

    def _backward(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        self._post_recv(s, mb, backward=True)
        grads_in = self.bwd_in.pop((s, mb), None) or defaultdict(list)
        for name, g in self._wait((K.RECV_B, s, mb)).items():
            grads_in[name].append(g)
        self._compute_start = time.perf_counter()
        grads = {n: sum(gs[1:], gs[0]) for n, gs in grads_in.items()}
        runner = self.runners[s]
        in_grads = runner.backward(mb, grads) if a.kind is K.B else runner.backward_input(mb, grads)
        for name in self.plan.stages[s].lookups:
            self.lookups.put_grad(name, mb, in_grads.get(name))
        remote = []
        for name in self.plan.stages[s].inputs:
            value = self.plan.values[name]
            if not value.requires_grad:
                continue
            g = in_grads.get(name)
            if g is None:  # the input did not reach the loss; its producer still waits
                g = torch.zeros(value.spec.shape, dtype=value.spec.dtype, device=self.transport.device)
            if self.rank_of(value.producer) == self.pp_rank:
                self.bwd_in[(value.producer, mb)][name].append(g)
            else:
                remote.append((name, value.producer, g))
        self._queue((K.SEND_B, s, mb), remote)

    def _weight(self, a: Action) -> None:
        self.runners[a.stage].backward_weight(a.microbatch)

    def _reduce_g(self, a: Action) -> None:
        grad = self.vocab.reduce_g(a.microbatch)
        if grad is not None:  # the last stage's rank: its output gradient of the microbatch
            self.bwd_in[(self.plan.num_stages - 1, a.microbatch)][self.plan.vocab_head.hidden].append(grad)

    # ---- communication ------------------------------------------------------------------
    def _queue(self, key: tuple[K, int, int], items: list[tuple[str, int, torch.Tensor]]) -> None:
        if not items:
            return
        self.to_send[key] = items
        if key not in self._send_listed:
            self._send(Action(key[1], key[0], key[2]))

    def _send(self, a: Action) -> None:
        backward = a.kind is K.SEND_B
        for name, dst_stage, t in self.to_send.pop((a.kind, a.stage, a.microbatch), []):
            check_spec(self.plan.values[name], t, "gradient of" if backward else "activation")
            self.transport.send(self.plan.values[name], t, self.peer(self.rank_of(dst_stage)),
                                self.transport.tag(backward, name, a.microbatch))

    def _post_recv(self, stage: int, mb: int, backward: bool) -> None:
        """Post the receives of ``stage``'s inputs from other ranks (backward: of its outputs'
        gradients, one from each consumer on another rank); once per stage and microbatch."""
        key = (K.RECV_B if backward else K.RECV_F, stage, mb)
        if key in self.posted:
            return
        posted = []
        for name, src in self._sources(stage, backward):
            if src != self.pp_rank:
                work, buf = self.transport.recv(self.plan.values[name], self.peer(src),
                                                self.transport.tag(backward, name, mb))
                posted.append((work, name, buf))
        self.posted[key] = posted

    def _sources(self, stage: int, backward: bool) -> list[tuple[str, int]]:
        """(value, the rank it comes from) for everything ``stage`` receives."""
        if not backward:
            return [(name, self.rank_of(self.plan.values[name].producer)) for name in self.plan.stages[stage].inputs]
        return [(name, self.rank_of(c)) for name in self.plan.stages[stage].outputs
                if self.plan.values[name].requires_grad for c in self.plan.values[name].consumers]

    def _wait(self, key: tuple[K, int, int]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for work, name, buf in self.posted.pop(key, []):
            self.transport.wait(work)
            full = self.transport.finish(self.plan.values[name], buf, backward=key[0] is K.RECV_B)
            out[name] = out[name] + full if name in out else full
        return out
