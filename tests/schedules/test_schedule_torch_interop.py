"""Interop with torch.distributed.pipelining: our CSV loads in torch's loader,
passes its validation and its comm simulation; torch's generators agree with
ours where both implement the same published schedule.

The only test of fxpipe.schedules that imports torch (the package itself does not).
"""
import pytest

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

from fxpipe.schedules import ActionKind, Schedule, generate, lower, validate  # noqa: E402

_Action = pipelining._Action
_KEEP = {"F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}


class FakeStage:
    """The attributes torch's schedule constructors read from a pipeline stage."""

    def __init__(self, stage_index, num_stages, group_size, group_rank=0):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank = {}


def torch_runtime(sched: Schedule):
    stages = [FakeStage(s, sched.num_stages, sched.num_ranks) for s in sched.stages_of_rank(0)]
    return pipelining._PipelineScheduleRuntime(stages, sched.num_microbatches)


def torch_simulate(order, mapping, num_stages):
    order = {r: [a for a in acts if a is not None and a.computation_type.value in _KEEP]
             for r, acts in order.items()}
    return pipelining._simulate_comms_compute(order, lambda s: mapping[s], num_stages)


def test_kind_spellings_and_text_form_match_torch():
    torch_values = {t.value for t in pipelining._ComputationType}
    ours = [k for k in ActionKind if not k.is_vocab]  # vocabulary passes are fxpipe's own
    assert {k.value for k in ours} <= torch_values
    for kind in ours:
        text = f"3{kind.value}12"
        assert str(_Action.from_str(text)) == text


CASES = [("1f1b", 4, 8, None), ("interleaved", 4, 8, 2), ("interleaved", 4, 10, 2),
         ("interleaved", 3, 7, 3), ("zb-h1", 4, 8, None), ("zb-v", 4, 8, 2)]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_torch_loads_validates_and_simulates_our_csv(name, p, m, v, tmp_path):
    ours = generate(name, p, m, v)
    # Compute-only CSV -> torch's loader: _validate_schedule infers the stage
    # mapping, then torch lowers it with its own _add_send_recv.
    path = tmp_path / "compute.csv"
    ours.write_csv(path)
    runtime = torch_runtime(ours)
    runtime._load_csv(str(path), format="compute_only")
    mapping = runtime.stage_index_to_group_rank
    assert mapping == {s: ours.stage_to_rank(s) for s in range(ours.num_stages)}
    torch_simulate(runtime.pipeline_order_with_comms, mapping, ours.num_stages)

    # Our lowered CSV -> torch's loader in compute_comms form -> its simulator.
    low = lower(ours)
    path = tmp_path / "lowered.csv"
    low.write_csv(path)
    runtime = torch_runtime(ours)
    runtime._load_csv(str(path), format="compute_comms")
    loaded = runtime.pipeline_order_with_comms
    assert {r: [str(a) for a in acts] for r, acts in loaded.items()} == \
        {r: [str(a) for a in acts] for r, acts in enumerate(low.actions)}
    timeline = torch_simulate(loaded, mapping, ours.num_stages)
    assert sum(a is not None for acts in timeline.values() for a in acts) == sum(map(len, low.actions))


def from_torch(order, name, m):
    rows = [",".join(str(a) for a in order[r] if a is not None and a.computation_type.value in _KEEP)
            for r in sorted(order)]
    return Schedule.from_csv("\n".join(rows) + "\n", name=name, num_microbatches=m)


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (2, 6, 3), (4, 12, 4)])
def test_torch_interleaved_equals_ours(p, m, v):
    # m % p == 0: torch uses rounds of p microbatches, Megatron's rule and ours.
    stages = [FakeStage(c * p, p * v, p) for c in range(v)]
    theirs = from_torch(pipelining.ScheduleInterleaved1F1B(stages, m).pipeline_order, "torch", m)
    assert theirs.actions == generate("interleaved", p, m, v).actions


def test_torch_1f1b_and_zbv_equal_ours():
    p, m = 4, 8
    one = pipelining.Schedule1F1B(FakeStage(0, p, p), m)
    # Schedule1F1B._get_pipeline_order (a debugging view in torch 2.13)
    # numbers the last rank's forwards from 1 (3F1..3F8 for m=8), so compare
    # the other ranks only; torch runs the last rank correctly in _step_microbatches.
    rows = {r: acts for r, acts in one.pipeline_order.items() if r < p - 1}
    ours = generate("1f1b", p, m).actions
    for r, acts in rows.items():
        assert [str(a) for a in acts if a is not None and a.computation_type.value in _KEEP] == \
            [str(a) for a in ours[r]]
    zbv = pipelining.ScheduleZBVZeroBubble([FakeStage(0, 2 * p, p), FakeStage(2 * p - 1, 2 * p, p)], m)
    theirs = from_torch(zbv.pipeline_order, "torch", m)
    assert theirs.actions == generate("zb-v", p, m).actions
    assert theirs.stage_ranks == generate("zb-v", p, m).stage_ranks


def test_our_validator_accepts_torch_schedules():
    p, m = 4, 8
    dual = pipelining.ScheduleDualPipeV([FakeStage(0, 2 * p, p), FakeStage(2 * p - 1, 2 * p, p)], m)
    # DualPipeV overlaps F and B in OVERLAP_F_B containers; flatten them.
    order = {r: [sub for a in acts if a is not None for sub in (a.sub_actions or (a,))]
             for r, acts in dual.pipeline_order.items()}
    theirs = from_torch(order, "dualpipev", m)
    validate(theirs)
    validate(lower(theirs))
