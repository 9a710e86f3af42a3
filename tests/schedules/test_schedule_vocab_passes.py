"""Vocabulary passes (fxpipe/schedules/vocab_actions.py): placement, validation, simulation."""
import itertools
import random

import pytest

from fxpipe.schedules import (Action, ActionKind, ScheduleError, StageDurations, add_vocab_passes, generate, lower,
                              simulate, split_output_layer, validate)
from fxpipe.schedules.vocab_actions import place_vocab_passes

K = ActionKind
GENERATORS = [("1f1b", None), ("interleaved", 2), ("zb-h1", None), ("zb-v", 2)]


def _durations(n, p, f=1.0, b=2.0, s=0.3, t=0.5):
    return StageDurations(forward=(f,) * n, backward=(b,) * n, weight=(b / 2,) * n,
                          vocab_forward=(s,) * p, vocab_backward=(t,) * p)


@pytest.mark.parametrize("name, v", GENERATORS)
@pytest.mark.parametrize("p, m", list(itertools.product((2, 4), (4, 8))))
def test_generated_schedules_with_vocab_passes_validate(name, v, p, m):
    base = generate(name, p, m, v)
    for offset in (0, 1):
        sched = add_vocab_passes(base, offset=offset)
        validate(sched)
        validate(lower(sched))  # SEND/RECV added around the passes still cannot deadlock
        assert lower(sched).compute_only().actions == sched.actions
        for r, acts in enumerate(sched.actions):
            vocab = [a for a in acts if a.kind.is_vocab]
            assert {a.stage for a in vocab} == {r} and len(vocab) == 5 * m
        if offset == 0:  # the original order is kept
            assert tuple(tuple(a for a in acts if not a.kind.is_vocab) for acts in sched.actions) == base.actions
    best = place_vocab_passes(base, _durations(base.num_stages, p))
    validate(lower(best))


def _last_rank_backward(sched, j):
    last = sched.num_stages - 1
    r = sched.stage_to_rank(last)
    step = next(k for k, a in enumerate(sched.actions[r]) if a.stage == last and a.kind in (K.B, K.I)
                and a.microbatch == j)
    return r, step


@pytest.mark.parametrize("name, v", GENERATORS)
def test_validator_rejects_t_pass_after_the_last_stage_backward(name, v):
    sched = add_vocab_passes(generate(name, 2, 4, v))
    j = 3  # the last microbatch: its REDUCE_G is every rank's last collective, so the order stays one
    r, b_step = _last_rank_backward(sched, j)
    acts = list(sched.actions[r])
    moved = [a for a in acts if a.microbatch == j and a.kind in (K.T, K.REDUCE_G)]
    rest = [a for a in acts if a not in moved]
    b_at = rest.index(acts[b_step])
    bad = sched.with_actions(rest[:b_at + 1] + moved + rest[b_at + 1:] if k == r else a
                             for k, a in enumerate(sched.actions))
    with pytest.raises(ScheduleError, match="REDUCE_G of microbatch 3"):
        validate(bad)
    with pytest.raises(ScheduleError):
        simulate(bad, _durations(sched.num_stages, 2))


def test_validator_rejects_ranks_disagreeing_on_collective_order():
    sched = add_vocab_passes(generate("1f1b", 2, 4), offset=1)
    acts = list(sched.actions[1])
    # Swap rank 1's first two collectives of different microbatches' S blocks.
    i = acts.index(Action(1, K.ALLREDUCE_S, 0))
    k = acts.index(Action(1, K.ALLREDUCE_S, 1))
    acts[i], acts[k] = acts[k], acts[i]
    bad = sched.with_actions([sched.actions[0], acts])
    with pytest.raises(ScheduleError, match="disagree on the order of collectives"):
        validate(bad)


def test_validator_rejects_s_before_the_broadcast_root_has_its_forward():
    sched = add_vocab_passes(generate("1f1b", 2, 2))
    acts = list(sched.actions[1])  # rank 1 holds the last stage: BCAST_H 0 moved before 1F0
    acts.remove(Action(1, K.BCAST_H, 0))
    acts.insert(0, Action(1, K.BCAST_H, 0))
    with pytest.raises(ScheduleError, match="1BCAST_H0 comes before 1F0"):
        validate(sched.with_actions([sched.actions[0], acts]))


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("f, b, s, t", [(1.0, 2.0, 0.3, 0.5), (1.0, 1.0, 0.2, 0.1), (0.5, 1.5, 1.0, 0.25)])
def test_1f1b_p2_step_time_matches_closed_form(m, f, b, s, t):
    """1F1B, p=2, offset 0, f <= b, no latency. The S and T blocks of j sit on
    both ranks where the last stage's F of j ends: rank 1 runs F_j S_j T_j B_j,
    rank 0 runs F_0 F_1 [V_0] B_0 [V_1] F_2 B_1 [V_2] ... B_{m-2} [V_{m-1}] B_{m-1}
    (V = S then T). V_j is a barrier ending at Z_j = max(both ranks' arrival) + s + t:
    Z_0 = 2f + s + t; then rank 0 arrives at V_j after B_{j-1} on both stages,
    Z_{j-1} + 2b, later than rank 1 (Z_{j-1} + b + f), so Z_j = Z_{j-1} + 2b + s + t.
    The step ends with B_{m-1} on both stages: Z_{m-1} + 2b = 2f + 2mb + m(s + t)."""
    sched = add_vocab_passes(generate("1f1b", 2, m))
    got = simulate(sched, _durations(2, 2, f, b, s, t)).makespan
    assert got == pytest.approx(2 * f + 2 * m * b + m * (s + t))


# ZB-V is left out: with m = 1 its rank 0 runs 3W0 before 0I0, a weight half on the path.
@pytest.mark.parametrize("name, v", [g for g in GENERATORS if g[0] != "zb-v"])
@pytest.mark.parametrize("p", (2, 3, 4))
def test_one_microbatch_step_time_with_latencies(name, v, p):
    """m = 1 is one path: the forward chain over the n stages (with a p2p latency per
    cross-rank hop), broadcast, S, all-reduce, T, reduce, the backward chain back
    (split schedules: n input-gradient halves, then stage 0's weight half)."""
    sched = add_vocab_passes(generate(name, p, 1, v))
    n = sched.num_stages
    hops = sum(sched.stage_ranks[k] != sched.stage_ranks[k + 1] for k in range(n - 1))
    f, b, s, t, lat, (c1, c2, c3) = 1.0, 2.0, 0.3, 0.5, 0.1, (0.05, 0.02, 0.07)
    got = simulate(sched, _durations(n, p, f, b, s, t), p2p_latency=lat, collective_latency=(c1, c2, c3)).makespan
    backward = n * (b - b / 2) + b / 2 if sched.splits_backward else n * b
    assert got == pytest.approx(n * f + backward + s + t + 2 * hops * lat + c1 + c2 + c3)


def _reference_makespan(sched, d, lat, coll):
    """An independent longest-path fixpoint over the dependence rules (docstring of
    simulate.py): start = max(rank free, inputs); a collective completes at the
    latest post (its rank's previous compute end) plus its latency."""
    last = sched.num_stages - 1
    start, end, post = {}, {}, {}
    dur = {K.F: d.forward, K.B: d.backward, K.S: d.vocab_forward, K.T: d.vocab_backward}
    coll_of = {K.BCAST_H: 0, K.ALLREDUCE_S: 1, K.REDUCE_G: 2}
    for _ in range(sum(map(len, sched.actions)) + 1):
        for r, acts in enumerate(sched.actions):
            free = 0.0
            for a in acts:
                if a.kind in coll_of:
                    post[(a, r)] = free
                    continue
                s, j = a.stage, a.microbatch
                need = [free]
                if a.kind is K.F and s > 0:
                    need.append(end.get((s - 1, K.F, j), float("inf")) + lat * (sched.stage_ranks[s - 1] != r))
                if a.kind is K.B:
                    need.append(end.get((s, K.F, j), float("inf")))
                    if s < last:
                        need.append(end.get((s + 1, K.B, j), float("inf")) + lat * (sched.stage_ranks[s + 1] != r))
                    else:
                        need.append(_done(post, K.REDUCE_G, j, sched, coll[2]))
                if a.kind is K.S:
                    need.append(_done(post, K.BCAST_H, j, sched, coll[0]))
                if a.kind is K.T:
                    need.append(max(end.get((s, K.S, j), float("inf")), _done(post, K.ALLREDUCE_S, j, sched, coll[1])))
                start[(s, a.kind, j)] = max(need)
                end[(s, a.kind, j)] = free = start[(s, a.kind, j)] + dur[a.kind][s]
    return max(end.values())


def _done(post, kind, j, sched, latency):
    times = [post.get((Action(r, kind, j), r), float("inf")) for r in range(sched.num_ranks)]
    return max(times) + latency


@pytest.mark.parametrize("p, m, offset", [(2, 1, 0), (2, 3, 1), (3, 2, 0), (3, 4, 2)])
def test_simulator_matches_a_brute_force_longest_path(p, m, offset):
    rng = random.Random(p * 100 + m * 10 + offset)
    sched = add_vocab_passes(generate("1f1b", p, m), offset=offset)
    for _ in range(3):
        d = StageDurations(forward=[rng.uniform(0.5, 2) for _ in range(p)],
                           backward=[rng.uniform(1, 3) for _ in range(p)], weight=[0.0] * p,
                           vocab_forward=[rng.uniform(0.1, 1) for _ in range(p)],
                           vocab_backward=[rng.uniform(0.1, 1) for _ in range(p)])
        lat, coll = rng.uniform(0, 0.3), tuple(rng.uniform(0, 0.3) for _ in range(3))
        got = simulate(sched, d, p2p_latency=lat, collective_latency=coll).makespan
        assert got == pytest.approx(_reference_makespan(sched, d, lat, coll))


def test_split_output_layer_moves_the_head_off_the_last_stage():
    d = StageDurations(forward=(1.0, 1.6), backward=(2.0, 3.2), weight=(1.0, 1.6))
    v = split_output_layer(d, 2, forward=0.6, backward=1.2)
    assert v.forward == pytest.approx((1.0, 1.0)) and v.backward == pytest.approx((2.0, 2.0))
    assert v.vocab_forward == (0.3, 0.3) and v.vocab_backward == (0.6, 0.6)
    with pytest.raises(ValueError, match="must fit in the last stage"):
        split_output_layer(d, 2, forward=2.0, backward=1.0)


def test_vocab_schedule_needs_vocab_durations():
    sched = add_vocab_passes(generate("1f1b", 2, 2))
    with pytest.raises(ValueError, match="vocab_forward"):
        simulate(sched, StageDurations.uniform(2))


def test_balanced_head_beats_head_on_the_last_stage():
    """The point of the passes: with a heavy head, the searched placement's step is
    shorter than the head on the last stage (1F1B, p=2, m=8)."""
    base = generate("1f1b", 2, 8)
    head = StageDurations(forward=(1.0, 1.6), backward=(2.0, 3.2), weight=(1.0, 1.6))
    vocab = split_output_layer(head, 2, forward=0.6, backward=1.2)
    assert simulate(place_vocab_passes(base, vocab), vocab).makespan < simulate(base, head).makespan - 5


def test_every_small_schedule_with_every_offset_validates():
    """Exhaustive over small sizes (GPipe and interleaved v=3 included): placement and
    the forwards-earlier offset never produce a schedule the validator refuses."""
    for name, v in GENERATORS + [("gpipe", None), ("interleaved", 3)]:
        for p in (2, 3):
            for m in range(1, 7):
                base = generate(name, p, m, v)
                for offset in (0, 1, 2):
                    validate(lower(add_vocab_passes(base, offset=offset)))


@pytest.mark.parametrize("name, v", GENERATORS)
def test_zero_times_still_place_validly(name, v):
    """Zero-length actions (I = B - W = 0, a free S) could tie a block's time with the
    action it must follow; placement floors every time first."""
    base = generate(name, 3, 5, v)
    n = base.num_stages
    d = StageDurations(forward=(1.0,) * n, backward=(2.0,) * n, weight=(2.0,) * n,
                       vocab_forward=(0.0,) * 3, vocab_backward=(0.5,) * 3)
    validate(lower(place_vocab_passes(base, d)))
    validate(lower(add_vocab_passes(base, d, offset=1)))


@pytest.mark.parametrize("name, v", GENERATORS)
def test_search_is_never_slower_than_the_unit_placement(name, v):
    """The unit-time cut is among the candidates: under these (the cost model's GPT-2
    8x256 times, pp=2) every cut at the durations' own times comes out slower than the
    unit cut for interleaved and ZB-H1, and the search must not return one of those."""
    base = generate(name, 2, 8, v)
    n = base.num_stages
    f, b = (0.057, 0.06), (0.114, 0.12)
    d = StageDurations(forward=f * (n // 2), backward=b * (n // 2), weight=tuple(x / 2 for x in b) * (n // 2),
                       vocab_forward=(0.076,) * 2, vocab_backward=(0.152,) * 2)
    latency = dict(p2p_latency=3e-4, collective_latency=(3e-4, 5e-5, 3e-4))
    best = place_vocab_passes(base, d, offsets=(0,), **latency)
    validate(lower(best))
    assert simulate(best, d, **latency).makespan <= simulate(add_vocab_passes(base), d, **latency).makespan + 1e-12
