"""The numba kernel of the simulator (see simulate.py for the contract).

A list scheduler with fixed per-rank order: an action starts when its rank is
free and its inputs exist -- the producing action's end, plus the p2p latency
when producer and consumer sit on different ranks. Because the order is fixed
and durations are known, each start is a longest path in the dependency DAG:
we sweep the ranks, advancing each as far as its inputs are known, until all
actions are placed or a sweep makes no progress (a deadlock).
"""
from __future__ import annotations

import numba
import numpy as np

# Kind codes, as ir.KIND_CODE assigns them (enum definition order).
(K_F, K_B, K_I, K_W, K_S, K_T, K_SEND_F, K_RECV_F, K_SEND_B, K_RECV_B,
 K_BCAST_H, K_ALLREDUCE_S, K_REDUCE_G) = range(13)

OK, DEADLOCK, DUPLICATE, INCOMPLETE = 0, 1, 2, 3


@numba.njit(cache=True, nogil=True)
def simulate_kernel(kind, stage, microbatch, offsets, stage_ranks, durations, latency, num_microbatches,
                    coll_latency):
    """Returns (status, start, end, blocked, peak, busy, finish).

    durations: float64[6, num_stages] for F, B, I, W, S, T (S and T indexed by
    their stage field, the rank's vocabulary block). coll_latency: float64[3], the
    time of BCAST_H, ALLREDUCE_S, REDUCE_G. A collective is posted without
    blocking when its rank reaches it and completes ``coll_latency`` after the
    last rank posted it; S waits for its BCAST_H, T for its ALLREDUCE_S and the
    last stage's B or I for its REDUCE_G. status: OK, or DEADLOCK
    (``blocked[r]`` = index of rank r's first unplaced action, -1 if done),
    DUPLICATE (``blocked[0]`` = index of the repeated action) or INCOMPLETE
    (some stage/microbatch lacks its F or backward). ``peak[r]``: most
    chunk-microbatches held at once (F adds one, B or W frees one);
    ``busy[r]``: rank r's total compute time; ``finish[r]``: its last compute end.
    """
    n_actions = kind.shape[0]
    num_ranks = offsets.shape[0] - 1
    num_stages = stage_ranks.shape[0]
    start = np.full(n_actions, np.nan)
    end = np.full(n_actions, np.nan)
    end_f = np.full((num_stages, num_microbatches), -1.0)
    end_g = np.full((num_stages, num_microbatches), -1.0)  # input grad ready: B or I
    w_state = np.zeros((num_stages, num_microbatches), dtype=np.int8)  # 1: I done, 2: W done
    blocked = np.full(num_ranks, -1, dtype=np.int64)
    peak = np.zeros(num_ranks, dtype=np.int64)
    busy = np.zeros(num_ranks)
    pos = offsets[:-1].copy()
    free = np.zeros(num_ranks)
    last = num_stages - 1
    vocab = False
    for n in range(n_actions):
        if kind[n] == K_S:
            vocab = True
    posts = np.zeros((3, num_microbatches), dtype=np.int64)  # ranks that posted each collective
    post_max = np.zeros((3, num_microbatches))  # the last post's time
    end_s = np.full((num_stages, num_microbatches), -1.0)  # S done, by vocabulary block

    remaining = 0
    for n in range(n_actions):
        if kind[n] < K_SEND_F:
            remaining += 1

    while remaining > 0:
        progress = False
        for r in range(num_ranks):
            n = pos[r]
            while n < offsets[r + 1]:
                k = kind[n]
                if k >= K_SEND_F:  # comm does not occupy the compute stream
                    if k >= K_BCAST_H:  # a collective: posted now, completes once all ranks posted
                        c = k - K_BCAST_H
                        posts[c, microbatch[n]] += 1
                        post_max[c, microbatch[n]] = max(post_max[c, microbatch[n]], free[r])
                        start[n] = free[r]
                    n += 1
                    continue
                s = stage[n]
                j = microbatch[n]
                t = free[r]
                ready = True
                if k == K_S or k == K_T:
                    c = 0 if k == K_S else 1
                    if posts[c, j] < num_ranks or (k == K_T and end_s[s, j] < 0.0):
                        ready = False
                    else:
                        t = max(t, post_max[c, j] + coll_latency[c])
                elif k == K_F:
                    if s > 0:
                        e = end_f[s - 1, j]
                        if e < 0.0:
                            ready = False
                        else:
                            if stage_ranks[s - 1] != r:
                                e += latency
                            t = max(t, e)
                elif k == K_W:
                    e = end_g[s, j]
                    if e < 0.0:
                        ready = False
                    elif w_state[s, j] != 1:  # a second W, or W after a full B
                        blocked[0] = n
                        return DUPLICATE, start, end, blocked, peak, busy, free
                    t = max(t, e)
                else:  # B or I: own forward, and the next stage's input grad
                    e = end_f[s, j]
                    if e < 0.0:
                        ready = False
                    t = max(t, e)
                    if s < num_stages - 1:
                        e = end_g[s + 1, j]
                        if e < 0.0:
                            ready = False
                        else:
                            if stage_ranks[s + 1] != r:
                                e += latency
                            t = max(t, e)
                    elif vocab:  # the last stage's backward starts from the reduced vocabulary gradient
                        if posts[2, j] < num_ranks:
                            ready = False
                        else:
                            t = max(t, post_max[2, j] + coll_latency[2])
                if not ready:
                    break
                finish = t + durations[k, s]
                busy[r] += durations[k, s]
                start[n] = t
                end[n] = finish
                free[r] = finish
                if k == K_S:
                    end_s[s, j] = finish
                elif k == K_T:
                    pass
                elif k == K_F:
                    if end_f[s, j] >= 0.0:
                        blocked[0] = n
                        return DUPLICATE, start, end, blocked, peak, busy, free
                    end_f[s, j] = finish
                elif k != K_W:
                    if end_g[s, j] >= 0.0:
                        blocked[0] = n
                        return DUPLICATE, start, end, blocked, peak, busy, free
                    end_g[s, j] = finish
                    if k == K_I:
                        w_state[s, j] = 1
                else:
                    w_state[s, j] = 2
                remaining -= 1
                progress = True
                n += 1
            pos[r] = n
        if not progress:
            for r in range(num_ranks):
                blocked[r] = pos[r] if pos[r] < offsets[r + 1] else -1
            return DEADLOCK, start, end, blocked, peak, busy, free

    for s in range(num_stages):
        for j in range(num_microbatches):
            if end_f[s, j] < 0.0 or end_g[s, j] < 0.0 or w_state[s, j] == 1:
                return INCOMPLETE, start, end, blocked, peak, busy, free

    # Comm entries span the transfer: from the producer's end, for `latency`.
    for n in range(n_actions):
        k = kind[n]
        s = stage[n]
        j = microbatch[n]
        if k == K_SEND_F:
            t = end_f[s, j]
        elif k == K_RECV_F:
            t = end_f[s - 1, j]
        elif k == K_SEND_B:
            t = end_g[s, j]
        elif k == K_RECV_B:
            t = end_g[s + 1, j]
        elif k >= K_BCAST_H:  # spans [this rank's post, completion]
            end[n] = post_max[k - K_BCAST_H, j] + coll_latency[k - K_BCAST_H]
            continue
        else:
            continue
        start[n] = t
        end[n] = t + latency

    # Peak in flight, in list order (it does not depend on durations).
    for r in range(num_ranks):
        held = 0
        for n in range(offsets[r], offsets[r + 1]):
            k = kind[n]
            if k == K_F:
                held += 1
                if held > peak[r]:
                    peak[r] = held
            elif k == K_B or k == K_W:
                held -= 1
    return OK, start, end, blocked, peak, busy, free


# Codes of check_structure_kernel, explained in validate.check_structure.
S_OK, S_STAGE, S_MICROBATCH, S_RANK, S_NO_PEER, S_LOCAL_COMM = range(6)


@numba.njit(cache=True, nogil=True)
def check_structure_kernel(kind, stage, microbatch, offsets, stage_ranks, num_microbatches):
    """Returns (code, index of the first offending action or -1)."""
    num_stages = stage_ranks.shape[0]
    for r in range(offsets.shape[0] - 1):
        for n in range(offsets[r], offsets[r + 1]):
            s = stage[n]
            if s < 0 or s >= num_stages:
                return S_STAGE, n
            if microbatch[n] < 0 or microbatch[n] >= num_microbatches:
                return S_MICROBATCH, n
            if stage_ranks[s] != r:
                return S_RANK, n
            k = kind[n]
            if k < K_SEND_F or k >= K_BCAST_H:  # compute, or a collective over all ranks
                continue
            peer = s + 1 if (k == K_SEND_F or k == K_RECV_B) else s - 1
            if peer < 0 or peer >= num_stages:
                return S_NO_PEER, n
            if stage_ranks[peer] == r:
                return S_LOCAL_COMM, n
    return S_OK, -1
