"""Cost profiles are untrusted input: a profile of impossible times is refused naming the group,
even when re-signed with a valid digest, and before any worker."""
from __future__ import annotations


import pytest


def test_a_resigned_cost_profile_of_impossible_times_is_refused_naming_the_group(tmp_path):
    import dataclasses

    from fxpipe.compiler.pipeline import capture_for, compile_program
    from fxpipe.costs import ProfileError, measured_profile, probe_groups
    from fxpipe.costs.profile import CostProfile, device_name, profile_key
    from fxpipe.ir.parallel_config import ParallelConfig
    from fxpipe.models.registry import build_workload

    import torch

    w = build_workload("gpt-tiny", batch=2, seq=16)
    config = ParallelConfig(costs="model")
    program = compile_program(capture_for(w.model, w.example_inputs, config, w.loss_fn), config, until="cost").program
    pconfig = config.partition_config(config.schedule_ir())
    _, probe = probe_groups(program, pconfig)
    n = len(probe.members)
    key = profile_key(program, probe, device_name(torch.device("cpu")), (1, 1, 1))
    base = CostProfile(key=key, device=device_name(torch.device("cpu")), groups=((1e-3, 2e-3, 1e-3, 1e-3),) * n,
                       latency_s=1e-5, bandwidth_bytes_per_s=1e9)

    def load(profile, name):
        return measured_profile(program, pconfig, str(profile.save(tmp_path / name)), device=torch.device("cpu"),
                                state_for=lambda names: {}, batch=w.example_inputs)

    assert load(base, "ok.json")[0] == base  # signed by save(): the check is on the numbers
    huge = dataclasses.replace(base, groups=((1e300, 1e300, 1e300, 1e300),) * n)
    with pytest.raises(ProfileError, match=r"group 0's fwd time is 1e\+300 s for one microbatch"):
        load(huge, "huge.json")
    odd = dataclasses.replace(base, groups=((1e-3, 2e-3, 1e-3, 1e-3),) * (n - 1) + ((1e3, 2e-3, 1e-3, 1e-3),))
    with pytest.raises(ProfileError, match=rf"group {n - 1}'s fwd time is .*x what the rest of the profile implies"):
        load(odd, "odd.json")


def test_a_profile_of_impossible_times_is_refused_before_workers(tmp_path):
    """The launcher's preflight holds the graph the workers will compile: a profile's
    numbers are judged there (which graph it was measured for, the workers check)."""
    import dataclasses

    from fxpipe.compiler.pipeline import capture_for, compile_program
    from fxpipe.costs import probe_groups
    from fxpipe.costs.profile import CostProfile
    from fxpipe.ir.parallel_config import ParallelConfig
    from fxpipe.job.preflight import check_profile_numbers
    from fxpipe.job.preflight_files import PreflightError
    from fxpipe.models.registry import build_workload

    w = build_workload("gpt-tiny", batch=2, seq=16)
    layout = ParallelConfig(tp=1, pp=2, microbatches=2, costs="model")
    program = compile_program(capture_for(w.model, w.example_inputs, layout, w.loss_fn), layout, until="cost").program
    n = len(probe_groups(program, layout.partition_config(layout.schedule_ir()))[1].members)
    path = CostProfile(key="k", device="cpu", groups=((1e300,) * 4,) * n, latency_s=0.0,
                       bandwidth_bytes_per_s=1e9).save(tmp_path / "p.json")
    with pytest.raises(PreflightError, match=r"--costs .*p.json: group 0's fwd time is 1e\+300 s"):
        check_profile_numbers(program, dataclasses.replace(layout, costs=str(path)))
