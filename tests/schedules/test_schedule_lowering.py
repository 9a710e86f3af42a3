"""Lowering: SEND/RECV placement, counts, and that compute is untouched."""
import pytest

from fxpipe.schedules import ActionKind, generate, lower, simulate, validate


def text(sched):
    return [" ".join(str(a) for a in rank) for rank in sched.actions]


def test_lower_1f1b_two_ranks():
    # Dry-run rounds: rank 0 runs F0@0 F1@1 B0@3 B1@5, rank 1 F0@1 B0@2 F1@3 B1@4.
    # A SEND follows its producer; its RECV joins the receiver's batch of the same round.
    assert text(lower(generate("1f1b", 2, 2))) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]


def test_lower_keeps_compute_order():
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"):
        s = generate(name, 4, 7)
        assert lower(s).compute_only().actions == s.actions


def test_comm_counts():
    # One SEND and one RECV each way per cross-rank stage boundary and microbatch.
    s = lower(generate("interleaved", 4, 8, 2))
    kinds = [a.kind for rank in s.actions for a in rank if a.kind.is_comm]
    assert len(kinds) == 4 * (s.num_stages - 1) * 8
    assert all(kinds.count(k) == (s.num_stages - 1) * 8 for k in
               (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B))
    # ZB-V: the turn p-1 -> p stays on rank p-1, so one boundary needs no comm.
    v = lower(generate("zb-v", 4, 8))
    assert sum(a.kind.is_comm for rank in v.actions for a in rank) == 4 * (v.num_stages - 2) * 8
    # One rank: nothing to send.
    assert not lower(generate("1f1b", 1, 4)).is_lowered


def test_lower_twice_is_an_error():
    with pytest.raises(ValueError, match="already has SEND/RECV"):
        lower(lower(generate("1f1b", 2, 2)))


def test_receives_are_posted_before_their_consumer_and_sends_after_their_producer():
    s = lower(generate("zb-h1", 4, 6))
    for rank in s.actions:
        pos = {a: k for k, a in enumerate(rank)}
        for a, k in pos.items():
            if a.kind is ActionKind.SEND_F:
                assert pos[type(a)(a.stage, ActionKind.F, a.microbatch)] < k
            if a.kind is ActionKind.RECV_B:
                consumer = type(a)(a.stage, ActionKind.I, a.microbatch)
                assert k < pos[consumer]


def test_simulated_compute_times_do_not_depend_on_comm_entries():
    s = generate("interleaved", 4, 8, 2)
    a, b = simulate(s, p2p_latency=0.3), simulate(lower(s), p2p_latency=0.3)
    assert a.makespan == b.makespan and a.busy == b.busy
    for r in range(4):
        got = {e.action: (e.start, e.end) for e in b.timeline.events(r)}
        for e in a.timeline.events(r):
            assert got[e.action] == (e.start, e.end)


def test_lowered_schedule_validates():
    validate(lower(generate("zb-v", 3, 5)))
