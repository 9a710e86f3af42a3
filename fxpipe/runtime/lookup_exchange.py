"""Embedding lookups of a table whose rows are split over pipeline ranks (``VocabLookup``).

The compiler (``passes/outline_lookups.py``) took the lookup out of the stage that reads
it; here the owners of the table's rows do it, microbatch by microbatch:

- forward of microbatch j: every owner looks j's token ids up in the rows it owns —
  an id outside them reads zeros — and sends its part to the rank of the consuming
  stage, which sums the parts (and its own, when it owns rows) into the stage's input
  just before that stage's F of j;
- backward: right after the consuming stage's B (or I) of j, that rank sends the
  input's gradient to every other owner, which runs its own part's backward, so
  autograd builds the gradient of its rows only (the fp32-master hooks fire as for any
  gradient).

Where each owner sends and receives is fixed before the step from a simulation of the
schedule (unit times, every rank the same). Sends never block and a part depends on
nothing but the batch and the owner's rows, so an owner may send part j anywhere: it
sends it ``LOOKUP_PARTS_AHEAD`` (2) microbatches ahead — before its first blocking
action that starts at or after the consumer's F of j - 2 (parts 0 and 1 first thing in
the step) — so the part is there when the consumer's F of j wants it. One ahead was
too late under real times: with vocabulary passes the owner was often still in an S
or T pass when the consumer's forward wanted the part, and the consumer waited for it
(and the stages behind it waited for the consumer). It takes the gradient before its
first blocking action that starts at or after the consumer's backward of j ends: every wait
is on an event earlier in that time order, so the point-to-point transfers (tagged per
lookup and microbatch) cannot deadlock with the schedule's own transfers and
collectives. An owner holds part j from its send to its gradient, the consumer j's
result only until its F, and every send is dropped once it completed: memory follows
the schedule's microbatches in flight (plus the ones sent ahead), not the step's m.

Every rank reads the batch, so every owner has the ids. Under tensor parallelism the
lookup is one TP rank's vocabulary-parallel one (``VocabLookup.vocab_parallel``): the
pipeline ranks of each TP rank sum their parts of its rows, and the stage sums the TP
ranks' results as it did. Each row is looked up by one rank only (the lowest holder),
so the sum adds zeros to exactly one copy of every embedding: bit-identical to one
process's lookup.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from fxpipe.ir.stage_plan import LOOKUP_PARTS_AHEAD, PipelinePlan, StageValue, VocabLookup
from fxpipe.runtime.mesh import MeshGroups
from fxpipe.runtime.transport import Pending, Transport
from fxpipe.schedules.actions import ActionKind
from fxpipe.schedules.schedule import Schedule
from fxpipe.schedules.simulate import StageDurations
from fxpipe.schedules.vocab_actions import start_times

K = ActionKind
_NON_BLOCKING = frozenset({K.SEND_F, K.SEND_B, K.RECV_F, K.RECV_B})
"""Actions that only post a transfer: they never wait, so they do not order the lookups."""


def wire_name(lookup: str) -> str:
    """The transport's name for a lookup's transfers (tags apart from the stage values)."""
    return f"lookup:{lookup}"


@dataclass
class _Lookup:
    plan: VocabLookup
    consumer: int
    """Pipeline rank running the consuming stage."""
    owners: tuple[int, ...]
    """Pipeline ranks holding rows of the table, the consumer excluded."""
    owned: torch.Tensor | None
    """Global row -> position in this rank's rows, -1 where another rank looks it up;
    None: this rank owns no row of the table."""
    wire: StageValue
    parts: dict[int, torch.Tensor] = field(default_factory=dict)
    """This rank's partial lookups in flight (with their autograd graph), by microbatch."""


class VocabLookups:
    """This rank's part in every ``VocabLookup`` of the plan (module docstring)."""

    def __init__(self, plan: PipelinePlan, actions: Schedule, groups: MeshGroups,
                 state: dict[str, torch.Tensor], device: torch.device, transport: Transport) -> None:
        self.groups, self.state, self.device, self.transport = groups, state, device, transport
        self.param_ready: Callable[[str], None] | None = None
        """ZeRO-1: called with a table's name before its rows are read (``runtime/param_waits.py``)."""
        me = groups.pp_rank
        self.lookups: list[_Lookup] = []
        for lk in plan.lookups:
            rows = plan.row_shards[lk.table]
            owned = None
            if rows.ranks[me]:
                owned = torch.full((rows.rows,), -1, dtype=torch.long)
                for a, b, holders in rows.segments():
                    if min(holders) == me:  # a row several ranks hold: looked up by the lowest
                        start = rows.offset(me, a)
                        owned[a:b] = torch.arange(start, start + b - a)
                owned = owned.to(device)
            consumer = actions.stage_to_rank(lk.stage)
            owners = tuple(p for p, r in enumerate(rows.ranks) if r and p != consumer)
            wire = StageValue(name=wire_name(lk.name), producer=-1, consumers=(lk.stage,), spec=lk.spec,
                              requires_grad=True)
            self.lookups.append(_Lookup(lk, consumer, owners, owned, wire))
        self.points = _points(actions, self.lookups, me)
        """Action index -> what this owner does before that action: ("send", lookup, j)
        or ("grad", lookup, j); index len(actions): after the last one."""
        self.mb: Sequence[Sequence[torch.Tensor]] = ()
        self.peak_parts = 0
        """Most partial lookups this rank held at once in the last step."""
        self.outbox: list[tuple[Pending, torch.Tensor]] = []
        """Sends not known to be complete, with the tensor each must keep alive."""

    def final_points(self, actions: Sequence) -> dict[str, int]:
        """Table -> index of this rank's action after whose end its rows' gradient is final
        (``grad_sync.py`` starts its reduction then): the consumer's last B or I of the
        stage, where it runs its own part's backward (``put_grad``); an owner's last gradient
        point, taken before that action (``len(actions)``: after the last one)."""
        out: dict[str, int] = {}
        for lk in self.lookups:
            if lk.consumer == self.groups.pp_rank and lk.owned is not None:
                last = max(i for i, a in enumerate(actions) if a.kind in (K.B, K.I) and a.stage == lk.plan.stage)
                out[lk.plan.table] = max(out.get(lk.plan.table, -1), last)
        for index, entries in self.points.items():
            for what, lk, _j in entries:
                if what == "grad":
                    out[lk.plan.table] = max(out.get(lk.plan.table, -1), index)
        return out

    def start(self, microbatches: Sequence[Sequence[torch.Tensor]]) -> None:
        self.mb, self.peak_parts = microbatches, 0
        for lk in self.lookups:
            lk.parts.clear()

    def _send(self, lk: _Lookup, t: torch.Tensor, pp_rank: int, backward: bool, mb: int) -> None:
        """Post a send of ``t`` (kept alive until it completes: ``_reap``)."""
        dst = self.groups.pp_peer(pp_rank)
        t = t.detach().contiguous()
        work = self.transport.post_send(t, dst, self.transport.tag(backward, lk.wire.name, mb))
        what = f"sending {'the gradient of ' if backward else ''}the embedding lookup {lk.plan.name!r} " \
               f"(microbatch {mb}) to rank {dst}"
        self.outbox.append((Pending(work, dst, what), t))
        self._reap()

    def _reap(self) -> None:
        self.outbox = [(p, t) for p, t in self.outbox if not p.work.is_completed()]

    def before(self, index: int) -> None:
        """What this rank does for other ranks' lookups before its action ``index``."""
        self._reap()
        for what, lk, j in self.points.get(index, ()):
            if what == "send":
                self._send(lk, self._part(lk, j), lk.consumer, False, j)
            else:
                pending, grad = self.transport.recv(lk.wire, self.groups.pp_peer(lk.consumer),
                                                    self.transport.tag(True, lk.wire.name, j))
                self.transport.wait(pending)
                torch.autograd.backward([lk.parts.pop(j)], [grad])

    def finish(self, num_actions: int) -> None:
        """The points after the last action, and every send completed; then nothing of
        the step may be in flight."""
        self.before(num_actions)
        for pending, _t in self.outbox:
            self.transport.wait(pending)
        self.outbox.clear()
        held = {lk.plan.name: sorted(lk.parts) for lk in self.lookups if lk.parts}
        assert not held, f"lookup parts still held after the step: {held}"

    def _part(self, lk: _Lookup, j: int) -> torch.Tensor:
        """This rank's rows' share of microbatch j's lookup: zeros where another rank owns
        the id (kept, with its autograd graph, until its gradient arrives)."""
        assert lk.owned is not None
        ids, pad = lk.plan.ids(self.mb[j][lk.plan.batch_input]), lk.plan.padding_idx
        rows = lk.owned.shape[0]
        if lk.plan.vocab_parallel:  # the TP rank's rows: token t is its row t - tp_rank·rows
            ids, pad = ids - self.groups.tp_rank * rows, pad - self.groups.tp_rank * rows
        pad = int(lk.owned[pad]) if lk.plan.padding_idx >= 0 and 0 <= pad < rows else -1
        if self.param_ready is not None:
            self.param_ready(lk.plan.table)
        out = owned_lookup(self.state[lk.plan.table], lk.owned, ids, pad)
        lk.parts[j] = out
        self.peak_parts = max(self.peak_parts, sum(len(x.parts) for x in self.lookups))
        return out

    def inputs(self, stage: int, mb: int) -> dict[str, torch.Tensor]:
        """The summed lookups stage ``stage`` reads for microbatch ``mb`` (on its rank)."""
        out = {}
        for lk in self.lookups:
            if lk.plan.stage != stage:
                continue
            total = self._part(lk, mb).detach() if lk.owned is not None else None
            for owner in lk.owners:
                pending, buf = self.transport.recv(lk.wire, self.groups.pp_peer(owner),
                                                   self.transport.tag(False, lk.wire.name, mb))
                self.transport.wait(pending)
                total = buf if total is None else total + buf
            out[lk.plan.name] = total
        return out

    def put_grad(self, name: str, mb: int, grad: torch.Tensor | None) -> None:
        """The gradient of lookup ``name``'s result for ``mb`` (None: it reached no loss):
        sent to every other owner, and this rank's own part's backward run."""
        for lk in self.lookups:
            if lk.plan.name != name:
                continue
            grad = grad if grad is not None else torch.zeros(lk.plan.spec.shape, dtype=lk.plan.spec.dtype,
                                                             device=self.device)
            for owner in lk.owners:
                self._send(lk, grad, owner, True, mb)
            if mb in lk.parts:
                torch.autograd.backward([lk.parts.pop(mb)], [grad])


def owned_lookup(table: torch.Tensor, owned: torch.Tensor, ids: torch.Tensor, pad: int) -> torch.Tensor:
    """The lookup of ``ids`` in the rows of ``table`` this rank owns (``owned``: global row
    -> position in ``table``, -1 where another rank looks it up), zeros for the others;
    with its autograd graph. ``pad``: the padding row's position in ``table``, or -1. The
    layout search times this very function (``costs/local.time_lookup_part``)."""
    rows = owned.shape[0]
    inside = (ids >= 0) & (ids < rows)
    local = torch.where(inside, owned[ids.clamp(0, rows - 1)], -1)
    hit = local >= 0
    with torch.enable_grad():
        out = torch.ops.aten.embedding(table, local.clamp(min=0), pad)
        return torch.where(hit.unsqueeze(-1), out, out.new_zeros(()))


def _points(actions: Schedule, lookups: Sequence[_Lookup], me: int) -> dict[int, list[tuple[str, _Lookup, int]]]:
    """Where this rank sends each part and takes each gradient (module docstring), from
    one unit-time simulation of the lowered schedule every rank runs."""
    mine = [lk for lk in lookups if me in lk.owners]
    if not mine:
        return {}
    durations = StageDurations.uniform(actions.num_stages)
    if actions.has_vocab_passes:  # S and T: any positive time
        p = actions.num_ranks
        durations = dataclasses.replace(durations, vocab_forward=(1.0,) * p, vocab_backward=(1.0,) * p)
    start, end = start_times(actions, durations)
    blocking = [(k, start[a]) for k, a in enumerate(actions.actions[me]) if a.kind not in _NON_BLOCKING]
    last = len(actions.actions[me])

    def first_from(t: float) -> int:
        return next((k for k, s in blocking if s >= t), last)

    # At one point: gradients of parts sent earlier first (they free memory), then the
    # sends, then gradients of parts sent at this very point.
    entries: dict[int, list[tuple[int, int, str, _Lookup]]] = defaultdict(list)
    for lk in mine:
        consumer = actions.actions[lk.consumer]
        forward = {a.microbatch: a for a in consumer if a.kind is K.F and a.stage == lk.plan.stage}
        backward = {a.microbatch: a for a in consumer if a.kind in (K.B, K.I) and a.stage == lk.plan.stage}
        for j in range(actions.num_microbatches):
            ahead = j - LOOKUP_PARTS_AHEAD
            sent = first_from(start[forward[ahead]]) if ahead >= 0 else 0
            taken = first_from(end[backward[j]])
            entries[sent].append((1, j, "send", lk))
            entries[taken].append((0 if sent < taken else 2, j, "grad", lk))
    return {k: [(what, lk, j) for _o, j, what, lk in sorted(v, key=lambda e: e[:2])] for k, v in entries.items()}
