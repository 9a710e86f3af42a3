"""Measured costs (fxpipe/costs): cache key, cache use and refusal, hostile profile
files, and that the partition follows measured costs where they differ from the model."""
import dataclasses
import json
import math

import pytest
import torch

import fxpipe
import fxpipe.costs as costs
from fxpipe.costs import CostProfile, ProfileError, apply_profile, measured_profile, probe_groups
from fxpipe.costs.measure import chunks
from fxpipe.costs.profile import FORMAT, cache_path, device_name, profile_key
from fxpipe.models import build_workload
from fxpipe.compiler.driver import run_passes
from fxpipe.passes.assign_stages import PartitionConfig, solve_partition

CPU = torch.device("cpu")


def _program(batch=2, name="gpt-tiny"):
    w = build_workload(name, batch=batch, seq=16, layers=4)
    program, _ = run_passes(fxpipe.capture(w.model, w.example_inputs, w.loss_fn))
    return w, program


def _config(stages=2):
    return PartitionConfig(num_stages=stages, stage_to_rank=tuple(range(stages)),
                           inflight=tuple(range(stages, 0, -1)))


def _state_for(program):
    return lambda names: {n: program.state[n].detach().clone().requires_grad_(program.state[n].requires_grad)
                          for n in names}


@pytest.fixture(scope="module")
def tiny():
    return _program()


def test_key_follows_what_the_numbers_depend_on(tiny):
    _, program = tiny
    _, probe = probe_groups(program, _config())
    dev = device_name(CPU)
    key = profile_key(program, probe, dev, (1, 1, 2))
    _, again = _program()  # captured afresh: same graph, same key
    assert profile_key(again, probe_groups(again, _config())[1], dev, (1, 1, 2)) == key
    assert profile_key(program, probe, "cuda:NVIDIA H100 80GB HBM3 (sm_90)", (1, 1, 2)) != key
    assert profile_key(program, probe, dev, (2, 1, 2)) != key
    _, wider = _program(batch=4)
    assert profile_key(wider, probe_groups(wider, _config())[1], dev, (1, 1, 2)) != key


def test_measure_caches_and_reuses(tiny, tmp_path, monkeypatch):
    w, program = tiny
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    calls = []
    real = costs.time_groups
    monkeypatch.setattr(costs, "time_groups", lambda *a, **k: calls.append(1) or real(*a, **k))
    run = lambda: measured_profile(program, _config(), "measure", device=CPU, state_for=_state_for(program),  # noqa: E731
                                   batch=w.example_inputs, repeats=1)
    profile, probe, fine = run()
    assert len(profile.groups) == len(probe.members) and len(calls) == 1
    assert all(f > 0 and b > 0 and i >= 0 and wt >= 0 for f, b, i, wt in profile.groups)
    path = cache_path(profile.key)
    assert CostProfile.load(path) == profile
    assert run()[0] == profile and len(calls) == 1  # second run: read, not timed
    # A stale profile under this key's name (another graph's numbers) is re-measured.
    stale = dataclasses.replace(profile, key="0" * 64)
    stale.save(path)
    assert run()[0].key == profile.key and len(calls) == 2


def test_profile_for_another_device_or_graph_is_refused(tiny, tmp_path):
    w, program = tiny
    fine, probe = probe_groups(program, _config())
    key = profile_key(program, probe, device_name(CPU), (1, 1, 1))
    groups = tuple((1e-3, 2e-3, 1e-3, 1e-3) for _ in probe.members)
    gpu = CostProfile(key=key, device="cuda:NVIDIA H100 80GB HBM3 (sm_90)", groups=groups,
                      latency_s=1e-5, bandwidth_bytes_per_s=1e10)
    path = gpu.save(tmp_path / "h100.json")
    with pytest.raises(ProfileError, match="measured on 'cuda:NVIDIA H100.*this rank's device is 'cpu"):
        measured_profile(program, _config(), str(path), device=CPU, state_for=_state_for(program),
                         batch=w.example_inputs)
    other = dataclasses.replace(gpu, device=device_name(CPU), key="f" * 64)
    with pytest.raises(ProfileError, match="another graph"):
        measured_profile(program, _config(), str(other.save(tmp_path / "other.json")), device=CPU,
                         state_for=_state_for(program), batch=w.example_inputs)
    mine = dataclasses.replace(other, key=key)
    got, _, _ = measured_profile(program, _config(), str(mine.save(tmp_path / "mine.json")), device=CPU,
                                 state_for=_state_for(program), batch=w.example_inputs)
    assert got == mine


def _doc(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["groups"][0].__setitem__(0, 5.0), "sha256"),            # edited number
    (lambda d: d.pop("device"), "expected the fields"),
    (lambda d: d.__setitem__("format", 99), "format"),
    (lambda d: d.__setitem__("groups", [[1, 2, 3]]), "sha256|must list"),
])
def test_hostile_profile_files(tmp_path, edit, match):
    good = CostProfile(key="k" * 64, device="cpu:x", groups=((1e-3, 2e-3, 1e-3, 1e-3),),
                       latency_s=0.0, bandwidth_bytes_per_s=math.inf)
    path = good.save(tmp_path / "p.json")
    assert CostProfile.load(path) == good
    doc = _doc(path)
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=match):
        CostProfile.load(path)


@pytest.mark.parametrize("text,match", [
    ("not json", "not a readable"), ('{"a": NaN}', "non-finite"), ("[1, 2]", "expected the fields"),
    ("[" * 100000 + "]" * 100000, "not a readable"),
])
def test_garbage_profile_files(tmp_path, text, match):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=match):
        CostProfile.load(path)


def test_negative_and_boolean_times_are_refused(tmp_path):
    import hashlib
    for bad in (-1.0, True):
        doc = dict(format=FORMAT, key="k", device="cpu:x", groups=[[bad, 0, 0, 0]], latency_s=0,
                   bandwidth_bytes_per_s=None)
        doc["sha256"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
        path = tmp_path / "p.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(ProfileError, match="finite number >= 0"):
            CostProfile.load(path)


def test_measured_costs_move_the_cut(tiny):
    """Where measured times differ from the model's (here: the first half of the graph
    three times slower than predicted), the partition differs and follows them."""
    _, program = tiny
    config = _config()
    fine, probe = probe_groups(program, config)
    n = len(probe.members)
    model = [(probe.graph.nodes[g]["fwd"], probe.graph.nodes[g]["bwd"]) for g in range(n)]
    slow = tuple((f * (3 if g < n // 2 else 1), b * (3 if g < n // 2 else 1), b / 2, b / 2)
                 for g, (f, b) in enumerate(model))
    profile = CostProfile(key="k", device="cpu:x", groups=slow, latency_s=0.0, bandwidth_bytes_per_s=math.inf)
    by_model, _ = solve_partition(program, config)
    measured = apply_profile(config, profile, probe, fine, split_backward=False)
    by_measure, result = solve_partition(program, measured)
    first = lambda a: sum(1 for k in a.values() if k == 0)  # noqa: E731
    assert first(by_measure) < first(by_model)
    # The solver's stage times are the measured ones: their sum is the profile's total.
    total = sum(f + b for f, b, _, _ in slow)
    assert sum(c.fwd_s + c.bwd_s for c in result.stages) == pytest.approx(total, rel=1e-9)


def test_node_times_share_each_group_exactly(tiny):
    _, program = tiny
    fine, probe = probe_groups(program, _config())
    groups = tuple((0.001 * (g + 1), 0.002, 0.0015, 0.0007) for g in range(len(probe.members)))
    profile = CostProfile(key="k", device="d", groups=groups, latency_s=0.0, bandwidth_bytes_per_s=math.inf)
    for split in (False, True):
        times = profile.node_times(fine, probe, split)
        assert set(times) == set(fine.nodes)
        for g, members in enumerate(probe.members):
            assert sum(times[m][0] for m in members) == pytest.approx(groups[g][0])
            back = groups[g][2] + groups[g][3] if split else groups[g][1]
            assert sum(times[m][1] for m in members) == pytest.approx(back)


@pytest.mark.parametrize("weights,parts", [([1] * 10, 3), ([5, 1, 1, 1, 1, 1], 2), ([1, 1], 4), ([0] * 5, 2)])
def test_chunks_cover_in_order(weights, parts):
    got = chunks(weights, parts)
    assert [i for r in got for i in r] == list(range(len(weights)))
    assert len(got) == min(parts, len(weights)) and all(len(r) for r in got)


def test_a_chunk_that_cannot_run_on_synthetic_inputs_keeps_the_cost_model(tiny, tmp_path, monkeypatch,
                                                                           capsys):
    """One rank's probe failing must not leave its peers waiting: its groups keep the
    cost model's times (said on stderr) and the mixed profile is not cached."""
    w, program = tiny
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))

    def fails(*a, **k):
        raise RuntimeError("split_with_sizes expects split_sizes to sum exactly to 64")

    monkeypatch.setattr(costs, "time_groups", fails)
    profile, probe, _ = measured_profile(program, _config(), "measure", device=CPU,
                                         state_for=_state_for(program), batch=w.example_inputs)
    for g, row in enumerate(profile.groups):
        fwd, bwd = probe.graph.nodes[g]["fwd"], probe.graph.nodes[g]["bwd"]
        assert row == (fwd, bwd, bwd / 2, bwd / 2)
    assert "could not run on synthetic inputs" in capsys.readouterr().err
    assert not cache_path(profile.key).exists()


def test_chunks_start_where_only_floats_arrive():
    from types import SimpleNamespace as NS

    from fxpipe.costs import _real_starts

    # Group 3 receives an integer (a routed-token count): no chunk may start there.
    floats, ints = NS(spec=NS(dtype=torch.float32)), NS(spec=NS(dtype=torch.int64))
    values = {"f": floats, "i": ints}
    inputs = {0: (), 1: ("f",), 2: ("f",), 3: ("i", "f"), 4: ("f",), 5: ("f",)}
    plan = NS(values=values, stages={g: NS(inputs=ins) for g, ins in inputs.items()})
    parts = [range(0, 3), range(3, 6)]
    assert _real_starts(plan, parts) == [range(0, 2), range(2, 6)]  # the nearest float-only start
    assert _real_starts(plan, [range(0, 2), range(2, 6)]) == [range(0, 2), range(2, 6)]
