"""Prove a schedule correct: complete, dependency-respecting, deadlock-free.

``validate`` runs three checks, cheapest first, and raises ScheduleError with
the step x rank grid and the offending action marked (like torch's
``_format_pipeline_order(..., error_step_number)``):

1. structure: every action's stage and microbatch exist, and it sits on the
   rank that owns its stage; comm actions name a real neighbour.
2. completeness: every stage runs F once and either B once or I and W once per
   microbatch; a lowered schedule has exactly one SEND and one RECV per
   cross-rank edge and none within a rank.
3. execution: every rank runs its list in order. Compute waits for its inputs
   (F(s) after F(s-1); B/I(s) after its own F and after B/I(s+1); W after its
   I). In a lowered schedule inputs from other ranks come only through a
   RECV, and a maximal run of consecutive SEND/RECV actions is checked as one
   ``batch_isend_irecv`` would run: it completes only once the partner of every
   op in it has been posted. That is the strictest reading of NCCL semantics (a
   send may block until its receive is posted), so a schedule passing it cannot
   deadlock under the looser ones either — including the runtime's, which posts
   every SEND and RECV as its own non-blocking ``isend``/``irecv``.

With vocabulary passes the rules of ``_vocab_checks.py`` apply as well: one
collective order on every rank, and the S/T/collective dependences.
"""
from __future__ import annotations

import numpy as np

from fxpipe.schedules import _sim_core
from fxpipe.schedules._vocab_checks import collective_order_mismatch, expected_vocab, vocab_needs
from fxpipe.schedules.actions import Action, ActionKind
from fxpipe.schedules.schedule import Schedule

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
_MAX_MARKS = 8

# comm kind -> (partner kind, partner stage offset); names follow torch:
# "2SEND_F0" pairs with "3RECV_F0", "3SEND_B0" with "2RECV_B0".
_PARTNER = {SEND_F: (RECV_F, 1), RECV_F: (SEND_F, -1), SEND_B: (RECV_B, -1), RECV_B: (SEND_B, 1)}


def _partner(a: Action) -> Action:
    kind, offset = _PARTNER[a.kind]
    return Action(a.stage + offset, kind, a.microbatch)


class ScheduleError(ValueError):
    """An invalid schedule. ``marks`` maps (rank, step) to what is wrong there;
    the message ends with the grid, those cells shown as ``>3F0<``."""

    def __init__(self, message: str, schedule: Schedule, marks: dict[tuple[int, int], str]):
        self.marks = dict(marks)
        self.reason = message
        grid = schedule.format_grid(self.marks)
        super().__init__(f"{schedule.name}: {message}\n\n{grid}")


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless ``schedule`` is complete, respects every
    dependency and cannot deadlock (see the module docstring)."""
    check_structure(schedule)
    check_complete(schedule)
    check_collective_order(schedule)
    check_execution(schedule)


def _cross(schedule: Schedule, a: int, b: int) -> bool:
    return schedule.stage_ranks[a] != schedule.stage_ranks[b]


def locate(schedule: Schedule, n: int) -> tuple[int, int]:
    """(rank, step) of the n-th action in ``schedule.arrays`` order."""
    offsets = schedule.arrays.offsets
    r = int(np.searchsorted(offsets, n, side="right") - 1)
    return r, int(n - offsets[r])


def check_structure(schedule: Schedule) -> None:
    """Stage and microbatch ranges, stage ownership, comm endpoints (numba; run
    before every simulation, so kept to one pass over the flat arrays)."""
    arr = schedule.arrays
    code, n = _sim_core.check_structure_kernel(
        arr.kind, arr.stage, arr.microbatch, arr.offsets, arr.stage_ranks, schedule.num_microbatches
    )
    if code == _sim_core.S_OK:
        return
    r, step = locate(schedule, n)
    a = schedule.actions[r][step]
    why = {
        _sim_core.S_STAGE: f"stage {a.stage} out of range: there are {schedule.num_stages} stages",
        _sim_core.S_MICROBATCH: f"microbatch {a.microbatch} out of range: m={schedule.num_microbatches}",
        _sim_core.S_RANK: f"stage {a.stage} lives on rank {schedule.stage_ranks[a.stage]}, not rank {r}",
        _sim_core.S_NO_PEER: f"{a} has no peer stage to talk to",
        _sim_core.S_LOCAL_COMM: f"{a} talks to a stage on the same rank: no communication is needed",
    }[code]
    raise ScheduleError(why, schedule, {(r, step): why})


def _expected_comm(schedule: Schedule) -> set[Action]:
    """The comm and vocabulary actions the schedule must hold, each exactly once:
    SEND/RECV per cross-rank edge if lowered; S, T and the collectives per rank
    (on its vocabulary block, stage r) and microbatch if it has vocabulary passes."""
    want = expected_vocab(schedule)
    if not schedule.is_lowered:
        return want
    for s in range(schedule.num_stages - 1):
        if _cross(schedule, s, s + 1):
            for j in range(schedule.num_microbatches):
                want |= {Action(s, SEND_F, j), Action(s + 1, RECV_F, j),
                         Action(s + 1, SEND_B, j), Action(s, RECV_B, j)}
    return want


def check_complete(schedule: Schedule) -> None:
    """Every (stage, microbatch) has F once and B once, or I once and W once;
    comm exactly once per cross-rank edge if the schedule is lowered."""
    where: dict[Action, tuple[int, int]] = {}
    marks: dict[tuple[int, int], str] = {}
    for r, acts in enumerate(schedule.actions):
        for step, a in enumerate(acts):
            if a in where and len(marks) < _MAX_MARKS:
                marks[(r, step)] = f"{a} repeats step {where[a][1]}"
            where.setdefault(a, (r, step))
    if marks:
        raise ScheduleError("repeated actions", schedule, marks)
    missing: list[str] = []
    for s in range(schedule.num_stages):
        for j in range(schedule.num_microbatches):
            has = {k for k in (F, B, I, W) if Action(s, k, j) in where}
            if F not in has:
                missing.append(str(Action(s, F, j)))
            if B in has and (I in has or W in has):
                step = where[Action(s, I if I in has else W, j)]
                marks.setdefault(step, f"stage {s} microbatch {j} runs both B and I/W")
            elif B not in has and not (I in has and W in has):
                for k in (I, W) if (I in has or W in has) else (B,):
                    if k not in has:
                        missing.append(str(Action(s, k, j)))
    want = _expected_comm(schedule)
    missing += sorted((str(a) for a in want if a not in where), key=lambda t: Action.parse(t).microbatch)
    for a, pos in where.items():
        if (a.kind.is_comm or a.kind.is_vocab) and a not in want:
            marks.setdefault(pos, f"{a} has no counterpart (unexpected communication)")
    if missing:
        for name in missing[:_MAX_MARKS]:
            a = Action.parse(name)
            r = schedule.stage_to_rank(a.stage)
            marks.setdefault((r, len(schedule.actions[r])), f"missing {name}")
        more = f" (+{len(missing) - _MAX_MARKS} more)" if len(missing) > _MAX_MARKS else ""
        raise ScheduleError(f"incomplete: missing {', '.join(missing[:_MAX_MARKS])}{more}", schedule, marks)
    if marks:
        raise ScheduleError("inconsistent actions", schedule, marks)


def check_collective_order(schedule: Schedule) -> None:
    """Every rank posts the same collectives in the same order."""
    if (found := collective_order_mismatch(schedule)) is not None:
        raise ScheduleError(found[0], schedule, found[1])


def _needs(schedule: Schedule, a: Action, rank: int, lowered: bool) -> list[tuple]:
    """The events action ``a`` waits for, as keys of the `done` set:
    ("c", Action) for a compute action, ("r", Action) for a completed RECV,
    ("k", (kind, microbatch)) for a completed collective."""
    s, j, S = a.stage, a.microbatch, schedule.num_stages
    last = S - 1
    if a.kind.is_vocab:
        return vocab_needs(schedule, a, rank)
    if a.kind is F:
        if s == 0:
            return []
        if lowered and _cross(schedule, s - 1, s):
            return [("r", Action(s, RECV_F, j))]
        return [("c", Action(s - 1, F, j))]
    if a.kind in (B, I):
        needs = [("c", Action(s, F, j))]
        if s == last and schedule.has_vocab_passes:
            needs.append(("k", (ActionKind.REDUCE_G, j)))
        if s < S - 1:
            if lowered and _cross(schedule, s, s + 1):
                needs.append(("r", Action(s, RECV_B, j)))
            else:
                needs.append(("g", (s + 1, j)))
        return needs
    if a.kind is W:
        return [("c", Action(s, I, j))]
    if a.kind is SEND_F:
        return [("c", Action(s, F, j))]
    if a.kind is SEND_B:
        return [("g", (s, j))]
    return []  # RECV: data comes from its partner


def check_execution(schedule: Schedule) -> None:
    """Execute the lists (see the module docstring); raise on a stall."""
    lowered = schedule.is_lowered
    acts = schedule.actions
    pos = [0] * schedule.num_ranks
    done: set = set()  # ("c", a) compute done, ("g", (s, j)) input grad of s ready, ("r", a) recv done
    posted: set[Action] = set()
    index = {a: (r, k) for r, rank in enumerate(acts) for k, a in enumerate(rank)}
    # Collectives complete in the one order every rank posts them (check_collective_order).
    order = [(a.kind, a.microbatch) for a in acts[0] if a.kind.is_collective]
    posts = {c: 0 for c in order}
    next_coll = 0

    def batch_end(r: int) -> int:
        k = pos[r]
        while k < len(acts[r]) and acts[r][k].kind.is_p2p:
            k += 1
        return k

    while True:
        progress = False
        for r, rank in enumerate(acts):
            while pos[r] < len(rank):
                a = rank[pos[r]]
                if a.kind.is_compute:
                    if not all(n in done for n in _needs(schedule, a, r, lowered)):
                        break
                    done.add(("c", a))
                    if a.kind in (B, I):
                        done.add(("g", (a.stage, a.microbatch)))
                    pos[r] += 1
                    progress = True
                    continue
                if a.kind.is_collective:  # posted without blocking
                    needs = _needs(schedule, a, r, lowered)
                    if not all(n in done for n in needs):
                        raise _stall_error(schedule, index, a, needs, done, posted)
                    posts[(a.kind, a.microbatch)] += 1
                    while next_coll < len(order) and posts[order[next_coll]] == len(acts):
                        done.add(("k", order[next_coll]))
                        next_coll += 1
                    pos[r] += 1
                    progress = True
                    continue
                end = batch_end(r)
                batch = rank[pos[r]:end]
                for op in batch:
                    if not all(n in done for n in _needs(schedule, op, r, lowered)):
                        raise _stall_error(schedule, index, op, _needs(schedule, op, r, lowered), done, posted)
                    if op not in posted:
                        posted.add(op)
                        progress = True
                if not all(_partner(op) in posted for op in batch):
                    break
                done.update(("r", op) for op in batch if op.kind in (RECV_F, RECV_B))
                pos[r] = end
                progress = True
        if all(p == len(rank) for p, rank in zip(pos, acts)):
            return
        if not progress:
            raise _deadlock_error(schedule, index, pos, lowered, done, posted)


def _describe(need: tuple) -> str:
    tag, what = need
    if tag == "k":
        return f"{what[0].value} of microbatch {what[1]} (posted by every rank)"
    if tag == "g":
        return f"the input gradient of stage {what[0]} microbatch {what[1]} (B or I)"
    return str(what)


def _stall_error(schedule, index, op, needs, done, posted) -> ScheduleError:
    missing = [n for n in needs if n not in done]
    r, k = index[op]
    why = f"{op} comes before {', '.join(_describe(n) for n in missing)} it depends on"
    return ScheduleError(f"dependency order violated: {why}", schedule, {(r, k): why})


def _deadlock_error(schedule, index, pos, lowered, done, posted) -> ScheduleError:
    marks: dict[tuple[int, int], str] = {}
    reasons = []
    for r, rank in enumerate(schedule.actions):
        if pos[r] >= len(rank):
            continue
        a = rank[pos[r]]
        if a.kind.is_compute:
            unmet = [n for n in _needs(schedule, a, r, lowered) if n not in done]
            later = [
                f"{n[1]} (step {index[n[1]][1]}, later on this rank)"
                for n in unmet
                if n[0] in ("c", "r") and index.get(n[1], (None,))[0] == r
            ]
            why = f"waits for {', '.join(later or [_describe(n) for n in unmet])}"
        else:
            k = pos[r]
            unposted = []
            while k < len(rank) and rank[k].kind.is_p2p:
                if _partner(rank[k]) not in posted:
                    unposted.append(str(_partner(rank[k])))
                k += 1
            why = f"comm batch waits for {', '.join(unposted)} to be posted"
        marks[(r, pos[r])] = why
        reasons.append(f"rank {r} {why}")
    kind = "dependency order violated" if any("later on this rank" in x for x in reasons) else "deadlock"
    return ScheduleError(f"{kind}: " + "; ".join(reasons), schedule, marks)
