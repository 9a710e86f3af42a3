"""The validator: broken schedules are caught, and the grid shows where."""
import pytest

from fxpipe.schedules import Action, Schedule, ScheduleError, generate, lower, validate
from fxpipe.schedules.actions import loop_stage_ranks


def edit(sched, rank, fn):
    acts = [list(a) for a in sched.actions]
    fn(acts[rank])
    return sched.with_actions(acts)


def swap(i, j):
    def fn(lst):
        lst[i], lst[j] = lst[j], lst[i]
    return fn


def from_text(rows, m, stage_ranks=None):
    actions = [[Action.parse(x) for x in row.split()] for row in rows]
    return Schedule(name="hand", num_microbatches=m,
                    stage_ranks=stage_ranks or loop_stage_ranks(len(rows), 1), actions=actions)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
def test_generated_schedules_validate(name):
    s = generate(name, 4, 6)
    validate(s)
    validate(lower(s))


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_swap_backward_before_its_forward():
    # 1F1B p=2, rank 1 is the last stage: "1F0 1B0 1F1 1B1". Swapping the first
    # two puts B0 before its own F0.
    s = edit(generate("1f1b", 2, 2), 1, swap(0, 1))
    with pytest.raises(ScheduleError) as err:
        validate(s)
    msg = str(err.value)
    assert "dependency order violated" in msg
    assert ">1B0<" in msg and "1F0 (step 1, later on this rank)" in msg
    assert "rank 0" in msg and "step 0" in msg  # the grid is printed
    assert (1, 0) in err.value.marks


def test_cross_rank_cycle_is_a_deadlock():
    # Swap two actions on each rank of 1F1B p=2, m=2: rank 0 waits for 1B0
    # before running 0F1; rank 1 wants microbatch 1 first, which needs 0F1.
    s = generate("1f1b", 2, 2)
    assert [str(a) for a in s.actions[0]] == ["0F0", "0F1", "0B0", "0B1"]
    assert [str(a) for a in s.actions[1]] == ["1F0", "1B0", "1F1", "1B1"]
    s = edit(edit(s, 0, swap(1, 2)), 1, swap(0, 2))  # rank 1: 1F1 1B0 1F0 1B1
    s = edit(s, 1, swap(1, 2))  # rank 1: 1F1 1F0 1B0 1B1
    with pytest.raises(ScheduleError, match="deadlock") as err:
        validate(s)
    msg = str(err.value)
    assert ">0B0<" in msg and ">1F1<" in msg
    assert "rank 0 waits for the input gradient of stage 1 microbatch 0" in msg
    assert "rank 1 waits for 0F1" in msg


def test_drop_an_action():
    s = edit(generate("1f1b", 3, 4), 2, lambda lst: lst.remove(Action.parse("2B1")))
    with pytest.raises(ScheduleError, match="incomplete: missing 2B1") as err:
        validate(s)
    assert "<-- rank 2: missing 2B1" in str(err.value)


def test_duplicate_action():
    s = edit(generate("gpipe", 2, 2), 0, lambda lst: lst.insert(1, Action.parse("0F0")))
    with pytest.raises(ScheduleError, match="repeated") as err:
        validate(s)
    assert "0F0 repeats step 0" in str(err.value)


def test_both_b_and_iw():
    s = edit(generate("zb-h1", 2, 2), 1, lambda lst: lst.append(Action.parse("1B0")))
    with pytest.raises(ScheduleError, match="inconsistent"):
        validate(s)


def test_w_before_i():
    s = edit(generate("zb-h1", 1, 2), 0, swap(1, 2))  # "0F0 0I0 0W0 ..." -> W0 before I0
    with pytest.raises(ScheduleError, match="dependency order violated") as err:
        validate(s)
    assert ">0W0<" in str(err.value)


def test_action_on_wrong_rank():
    s = edit(generate("1f1b", 2, 2), 0, lambda lst: lst.__setitem__(0, Action.parse("1F0")))
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1, not rank 0"):
        validate(s)


def test_out_of_range():
    s = edit(generate("1f1b", 2, 2), 0, lambda lst: lst.__setitem__(0, Action.parse("0F7")))
    with pytest.raises(ScheduleError, match="microbatch 7 out of range: m=2"):
        validate(s)


def test_lowered_recv_after_its_consumer():
    low = lower(generate("1f1b", 2, 2))
    rank1 = [str(a) for a in low.actions[1]]
    i, j = rank1.index("1RECV_F0"), rank1.index("1F0")
    assert i < j
    with pytest.raises(ScheduleError, match="later on this rank"):
        validate(edit(low, 1, swap(i, j)))


def test_lowered_missing_send():
    low = lower(generate("1f1b", 2, 2))
    with pytest.raises(ScheduleError, match="missing 0SEND_F1"):
        validate(edit(low, 0, lambda lst: lst.remove(Action.parse("0SEND_F1"))))


def test_comm_within_a_rank_is_rejected():
    s = generate("zb-v", 2, 3)  # stages 1 and 2 share rank 1: no comm between them
    bad = edit(lower(s), 1, lambda lst: lst.append(Action.parse("1SEND_F0")))
    with pytest.raises(ScheduleError, match="same rank"):
        validate(bad)


def test_rendezvous_deadlock_that_compute_order_alone_allows():
    # Rank 1 runs microbatch 1 before 0. Fine as compute (rank 1 just waits) ...
    compute = from_text(["0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"], m=2)
    validate(compute)
    # ... but if rank 1 posts only the receive it consumes next, rank 0's first
    # send (of microbatch 0) has no receive posted while rank 1 waits for
    # microbatch 1: with sends that block until matched, both ranks hang.
    naive = from_text([
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1",
    ], m=2)
    with pytest.raises(ScheduleError, match="deadlock") as err:
        validate(naive)
    assert "comm batch waits for 1RECV_F0 to be posted" in str(err.value)
    # lower() places receives in dry-run rounds and gets it right.
    validate(lower(compute))
