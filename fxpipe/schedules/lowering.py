"""Lowering: add SEND/RECV to a compute-only schedule.

Where the sends and receives go decides whether the runtime can deadlock. We
place them by a lockstep dry run, the idea of torch's ``_add_send_recv``: run
the compute lists with unit durations (every action takes one round and
starts once its inputs exist), then

- put each SEND right after the compute that produced its tensor, and
- put the matching RECV on the receiving rank *in the same round*, i.e. after
  whatever that rank computed up to then and before its next compute.

Within a round every rank's comm ops then form one batch, and every op in a
round-t batch has its partner in the partner's round-t batch. By induction on
rounds, each rank reaches its round-t batch (its compute up to t had its
inputs in the dry run) and the batch completes (every partner is posted), so
the lowered schedule cannot deadlock even under the strictest semantics: a run
of consecutive SEND/RECV posted as one ``batch_isend_irecv``, a send blocking
until its receive is posted. ``validate`` re-checks exactly that by executing
the lowered lists. The runtime is looser still: it posts each SEND and RECV as
one non-blocking ``isend``/``irecv`` (``runtime/transport.py``).

Vocabulary passes (``vocab_actions.py``) take part in the dry run like any
compute (S and T one round each; a collective completes in the round its last
rank posts it); a collective keeps its place between its rank's computes,
after the batch of the round it is posted in.

Receives are also posted as early as they can be, so the transfer overlaps
the receiver's compute (Megatron instead posts a receive just before its
consumer and pairs it with a send, ``send_forward_recv_backward``).
"""
from __future__ import annotations

import numpy as np

from fxpipe.schedules import _sim_core
from fxpipe.schedules.actions import KIND_CODE, KIND_OF_CODE, Action, ActionKind
from fxpipe.schedules.schedule import Schedule, ScheduleArrays, prime_arrays
from fxpipe.schedules.simulate import kernel_error
from fxpipe.schedules.validate import check_structure

F, B, I = ActionKind.F, ActionKind.B, ActionKind.I  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B


def lower(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with SEND/RECV actions inserted (see module doc).

    Requires a compute-only schedule whose compute order is executable
    (raises ScheduleError with the grid otherwise). Sends and receives are
    named as in torch.distributed.pipelining: ``2SEND_F0`` on stage 2's rank
    pairs with ``3RECV_F0`` on stage 3's; no comm between stages on one rank.
    """
    if schedule.is_lowered:
        raise ValueError(
            f"{schedule.name}: schedule already has SEND/RECV actions; lower the compute-only "
            "schedule (schedule.compute_only()) instead"
        )
    check_structure(schedule)
    arr = schedule.arrays
    unit = np.ones((6, schedule.num_stages))
    status, start, _end, blocked, _peak, _busy, _finish = _sim_core.simulate_kernel(
        arr.kind, arr.stage, arr.microbatch, arr.offsets, arr.stage_ranks, unit, 0.0,
        schedule.num_microbatches, np.zeros(3),
    )
    if status != _sim_core.OK:
        raise kernel_error(schedule, status, blocked)
    # Vectorized over all compute actions n: which ones produce a tensor
    # another rank needs, and in which dry-run round.
    rounds = start.astype(np.int64)
    kind, stage, mb, stage_ranks = arr.kind, arr.stage.astype(np.int64), arr.microbatch, arr.stage_ranks
    rank = np.repeat(np.arange(schedule.num_ranks), np.diff(arr.offsets))
    last = schedule.num_stages - 1
    code = KIND_CODE
    fwd = (kind == code[F]) & (stage < last)
    fwd &= stage_ranks[np.minimum(stage + 1, last)] != rank
    bwd = ((kind == code[B]) | (kind == code[I])) & (stage > 0)
    bwd &= stage_ranks[np.maximum(stage - 1, 0)] != rank
    f_idx, b_idx = np.flatnonzero(fwd), np.flatnonzero(bwd)
    # Comm entries: (rank, round, phase, kind code, stage, microbatch).
    # Phase orders a round on one rank: its compute (0), its sends (1), then
    # the receives other ranks' compute of that round produced (2).
    parts = [
        (rank[f_idx], rounds[f_idx], 1, code[SEND_F], stage[f_idx], mb[f_idx]),
        (stage_ranks[stage[f_idx] + 1], rounds[f_idx], 2, code[RECV_F], stage[f_idx] + 1, mb[f_idx]),
        (rank[b_idx], rounds[b_idx], 1, code[SEND_B], stage[b_idx], mb[b_idx]),
        (stage_ranks[stage[b_idx] - 1], rounds[b_idx], 2, code[RECV_B], stage[b_idx] - 1, mb[b_idx]),
    ]
    n_comm = sum(len(p[0]) for p in parts)
    c_rank = np.concatenate([p[0] for p in parts]).astype(np.int64)
    c_round = np.concatenate([p[1] for p in parts])
    c_phase = np.concatenate([np.full(len(p[0]), p[2]) for p in parts])
    c_kind = np.concatenate([np.full(len(p[0]), p[3], dtype=np.int8) for p in parts])
    c_stage = np.concatenate([p[4] for p in parts]).astype(np.int32)
    c_mb = np.concatenate([p[5] for p in parts]).astype(np.int32)

    all_rank = np.concatenate([rank, c_rank])
    order = np.lexsort((
        np.arange(len(all_rank)),  # stable: creation order breaks the remaining ties
        np.concatenate([np.zeros(len(rank), dtype=np.int64), c_phase]),
        np.concatenate([rounds, c_round]),
        all_rank,
    ))
    comm_actions = [
        Action(s, KIND_OF_CODE[k], j) for s, k, j in zip(c_stage.tolist(), c_kind.tolist(), c_mb.tolist())
    ]
    pool = [a for acts in schedule.actions for a in acts] + comm_actions
    flat = [pool[i] for i in order.tolist()]
    counts = np.bincount(all_rank, minlength=schedule.num_ranks)
    offsets = np.zeros(schedule.num_ranks + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    result = schedule.with_actions(flat[offsets[r]:offsets[r + 1]] for r in range(schedule.num_ranks))
    # The flat arrays are at hand: prime the cache instead of re-walking 3 x N objects.
    prime_arrays(result, ScheduleArrays(
        kind=np.concatenate([kind, c_kind])[order],
        stage=np.concatenate([arr.stage, c_stage])[order],
        microbatch=np.concatenate([mb, c_mb])[order],
        offsets=offsets,
        stage_ranks=stage_ranks,
    ))
    assert offsets[-1] == len(kind) + n_comm
    return result
