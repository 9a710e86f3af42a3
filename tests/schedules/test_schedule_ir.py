"""The IR: action text form, CSV, stage -> rank mappings, cached arrays."""
import dataclasses

import numpy as np
import pytest

from fxpipe.schedules import Action, ActionKind, Schedule, generate, lower
from fxpipe.schedules.actions import loop_stage_ranks, v_stage_ranks


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3F0", Action(3, ActionKind.F, 0)),
        ("1SEND_B2", Action(1, ActionKind.SEND_B, 2)),
        ("0W5", Action(0, ActionKind.W, 5)),
        ("12RECV_F63", Action(12, ActionKind.RECV_F, 63)),
        ("2I10", Action(2, ActionKind.I, 10)),
        ("7B1", Action(7, ActionKind.B, 1)),
    ],
)
def test_action_text_round_trip(text, expected):
    assert Action.parse(text) == expected
    assert str(expected) == text
    assert Action.parse(str(expected)) == expected


def test_every_kind_round_trips():
    for kind in ActionKind:
        a = Action(4, kind, 9)
        assert Action.parse(str(a)) == a


@pytest.mark.parametrize("bad", ["F0", "3X0", "3F", "", "3 F0", "-1F0", "3SEND0"])
def test_action_parse_rejects(bad):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(bad)


def test_action_is_frozen():
    a = Action(0, ActionKind.F, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.stage = 1


def test_kind_spellings_match_torch():
    # torch.distributed.pipelining._ComputationType values (checked against the
    # real enum in test_schedule_torch_interop.py).
    # The vocabulary passes and their collectives are fxpipe's own (no torch counterpart).
    torch_kinds = [k.value for k in ActionKind if not k.is_vocab]
    assert torch_kinds == ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
    assert {k for k in ActionKind if k.is_compute and not k.is_vocab} == {
        ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W}
    assert {k.value for k in ActionKind if k.is_vocab} == {"S", "T", "BCAST_H", "ALLREDUCE_S", "REDUCE_G"}


@pytest.mark.parametrize(
    "name, p, m, v", [("1f1b", 4, 8, None), ("interleaved", 3, 7, 3), ("zb-h1", 2, 5, None), ("zb-v", 4, 9, 2)]
)
def test_csv_round_trip(name, p, m, v, tmp_path):
    for sched in (generate(name, p, m, v), lower(generate(name, p, m, v))):
        text = sched.to_csv()
        assert len(text.splitlines()) == p
        assert text.splitlines()[0].split(",")[0] == str(sched.actions[0][0])
        back = Schedule.from_csv(text, name=name)
        assert back.actions == sched.actions
        assert back.stage_ranks == sched.stage_ranks  # inferred, V shape included
        assert back.num_microbatches == m
        path = tmp_path / f"{name}.csv"
        sched.write_csv(path)
        assert Schedule.read_csv(path, name=name) == sched


def test_csv_skips_torch_empty_cells():
    # torch's _dump_csv writes its None placeholders as empty cells.
    s = Schedule.from_csv("0F0,,0B0\n,1F0,1B0\n")
    assert [str(a) for a in s.actions[0]] == ["0F0", "0B0"]
    assert s.stage_ranks == (0, 1)


def test_csv_rejects_stage_on_two_ranks():
    with pytest.raises(ValueError, match="stage 0 appears on rank 0 and on rank 1"):
        Schedule.from_csv("0F0,0B0\n0F1,1F0\n")


def test_stage_to_rank_mappings():
    assert loop_stage_ranks(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert v_stage_ranks(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    s = generate("interleaved", 4, 8, 3)
    assert s.num_stages == 12 and s.num_chunks == 3
    assert [s.stage_to_rank(c) for c in range(12)] == [c % 4 for c in range(12)]
    assert s.stages_of_rank(1) == (1, 5, 9)
    v = generate("zb-v", 4, 8)
    assert v.num_stages == 8
    assert all(v.stage_to_rank(r) == r and v.stage_to_rank(2 * 4 - 1 - r) == r for r in range(4))


def test_lowering_primes_arrays_identical_to_a_fresh_encoding():
    low = lower(generate("interleaved", 4, 6, 2))
    fresh = Schedule(name=low.name, num_microbatches=low.num_microbatches,
                     stage_ranks=low.stage_ranks, actions=low.actions).arrays
    for got, want in zip(low.arrays, fresh):
        np.testing.assert_array_equal(got, want)


def test_format_grid_marks_and_windows():
    s = generate("gpipe", 2, 40)
    grid = s.format_grid({(1, 30): "look here"}, window=2)
    assert ">1F30<" in grid and "<-- rank 1: look here" in grid
    assert "steps not shown" in grid
    assert len(grid.splitlines()) < 12
