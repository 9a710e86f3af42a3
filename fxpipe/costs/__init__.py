"""Measured costs for the partitioner: ``costs="measure" | "model" | PATH``.

``measured_profile`` times the probe groups of the captured graph on the ranks'
devices (``measure.py``), probes the pipeline link (``link.py``) and caches the
result on disk keyed by graph, shapes, device and layout (``profile.py``); a second
run with the same key pays nothing. ``apply_profile`` turns a profile into the
per-node times and link parameters the partition pass optimises.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from fxpipe.costs.link import probe_link
from fxpipe.costs.measure import chunks, time_groups
from fxpipe.costs.profile import (CostProfile, ProfileError, cache_path, check_plausible, check_usable, device_name,
                                  profile_key)
from fxpipe.ir.parallel_config import parse_costs
from fxpipe.partition import Coarsening, coarsen
from fxpipe.passes.assign_stages import build_problem_graph
from fxpipe.passes.coalesce_blocks import coalesce_blocks_pass, split_block_keys
from fxpipe.passes.split import split_program
from fxpipe.runtime.launch import rank0_decides

__all__ = ["CostProfile", "ProfileError", "apply_profile", "measured_profile",
           "parse_costs", "probe_groups"]

PROBE_GROUPS = 64
"""Probe groups timed per model: fine enough that the ILP's cuts fall between or
inside groups whose time is known, coarse enough that each timing is well above the
timer's and Python's per-call overhead."""


def probe_groups(program, config, fine=None) -> tuple:
    """(fine graph with cost-model times, its coarsening into probe groups). ``fine``: the
    fine graph of ``program`` under ``config`` where the caller has built it already."""

    fine = build_problem_graph(program, config) if fine is None else fine
    keyed = fine.copy()  # the blocks of a split matmul share one probe group
    for node, key in split_block_keys(program).items():
        if node in keyed:
            keyed.nodes[node]["key"] = key
    return fine, coarsen(keyed, min(PROBE_GROUPS, config.max_groups, fine.number_of_nodes()))


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"fxpipe: {msg}", file=sys.stderr, flush=True)


def measured_profile(program, config, source: str, *, device: torch.device,
                     state_for: Callable[[Sequence[str]], Mapping[str, torch.Tensor]],
                     batch: Sequence[torch.Tensor], mesh=None, mesh_groups=None, context=None,
                     repeats: int = 3, use_cache: bool = True) -> tuple[CostProfile, Coarsening, object]:
    """The cost profile for ``program`` on this device: from ``source`` (a path), the cache,
    or measured now. Collective when torch.distributed is initialised (every rank calls it).

    ``state_for(names)`` returns this rank's (sharded) parameters for ``names``;
    ``batch`` is one microbatch on ``device``; ``mesh``/``mesh_groups`` place this rank."""

    fine, probe = probe_groups(program, config)
    dims = (mesh.tp, mesh.dp, mesh.pp) if mesh is not None else (1, 1, 1)
    dev = device_name(device)
    key = profile_key(program, probe, dev, dims)
    n = len(probe.members)
    if source != "measure":
        profile = CostProfile.load(source)
        check_usable(profile, key, dev, n, f"cost profile {source}")
        check_plausible(profile, probe, f"cost profile {source}")
        _log(f"costs: using {source} ({n} groups measured on {profile.device})")
        return profile, probe, fine
    distributed = dist.is_initialized()
    path = cache_path(key)

    def cached() -> CostProfile | None:
        if not (use_cache and path.exists()):
            return None
        try:
            found = CostProfile.load(path)
            check_usable(found, key, dev, n, f"cached profile {path}")
            check_plausible(found, probe, f"cached profile {path}")
            return found
        except ProfileError as e:  # stale, foreign or damaged: measure again
            _log(f"costs: ignoring {e}")
            return None

    reused = rank0_decides(cached)  # every rank measures, or none does
    if reused is not None:
        _log(f"costs: reusing {path} ({n} groups)")
        return reused, probe, fine

    # One probe group per stage; blocks of a split matmul in one group run as one block.
    timed = coalesce_blocks_pass(program.replace(stages=probe.expand({g: g for g in range(n)})))
    plan = split_program(timed, dict(timed.stages), num_stages=n)
    weights = [sum(probe.graph.nodes[g][k] for k in ("fwd", "bwd")) for g in range(n)]
    cells = dims[1] * dims[2]
    cell = mesh_groups.pp_rank * dims[1] + mesh_groups.dp_rank if mesh_groups is not None else 0
    mine = _real_starts(plan, chunks(weights, cells))
    mine = mine[cell] if cell < len(mine) else range(0)
    names = list(dict.fromkeys(p for g in mine for p in plan.stage_params(g)))
    _log(f"costs: timing {n} groups of the graph on {dev} over {cells} cell(s) of the mesh")
    state = state_for(names)
    try:
        times = time_groups(plan, mine, state, batch, device, repeats=repeats, context=context,
                           progress=_log)
    except Exception as exc:  # noqa: BLE001 - any failure: the peers must not wait for us
        # A chunk's first group gets synthetic inputs; a value that sizes tensors (routed
        # token counts) can make it fail. Its groups keep the cost model's times, and every
        # rank still reaches the gather below instead of waiting out the timeout.
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        _log(f"costs: groups {mine.start}-{mine.stop - 1} could not run on synthetic inputs "
             f"({type(exc).__name__}: {first}); they keep the cost model's times")
        times = {g: None for g in mine}
    del state
    gathered = [times]
    if distributed:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, times)
    per_group: dict[int, list] = {}
    for part in gathered:
        for g, t in part.items():
            per_group.setdefault(g, []).append(t)
    missing = [g for g in range(n) if g not in per_group]
    assert not missing, f"probe groups {missing} were timed by no rank"
    # tp ranks of a cell time the same groups together: the slowest is what the step waits for.
    rows = tuple(_model_row(probe, g) if any(t is None for t in per_group[g]) else
                 tuple(max(t[i] for t in per_group[g]) for i in range(4)) for g in range(n))
    modelled = sum(1 for g in range(n) if any(t is None for t in per_group[g]))
    latency, bandwidth = 0.0, float("inf")
    if distributed and mesh_groups is not None and dims[2] > 1:
        latency, bandwidth = probe_link(mesh_groups.mesh.rank(pp=1, dp=0, tp=0), device)
    profile = CostProfile(key=key, device=dev, groups=rows, latency_s=latency,
                          bandwidth_bytes_per_s=bandwidth)
    if use_cache and (not distributed or dist.get_rank() == 0) and not modelled:
        try:
            _log(f"costs: saved {profile.save(path)}")
        except OSError as e:
            _log(f"costs: could not cache the profile at {path} ({e})")
    return profile, probe, fine


def _real_starts(plan, parts: list[range]) -> list[range]:
    """Move each chunk's start to a nearby group that receives only floating-point values.

    A chunk's first group runs on synthetic inputs: random floats are as good as real
    ones for timing, but a synthetic integer (a routed-token count, an index) can make
    the group fail or take another path. Later groups of a chunk receive real values."""
    def real(g: int) -> bool:
        return all(plan.values[v].spec.dtype.is_floating_point for v in plan.stages[g].inputs)

    starts = [r.start for r in parts]
    end = parts[-1].stop if parts else 0
    for i in range(1, len(starts)):
        lo, hi = starts[i - 1] + 1, (starts[i + 1] if i + 1 < len(starts) else end) - 1
        near = sorted(range(lo, hi + 1), key=lambda g: (abs(g - starts[i]), g))
        starts[i] = next((g for g in near if real(g)), starts[i])
    return [range(a, b) for a, b in zip(starts, starts[1:] + [end])]


def _model_row(probe: Coarsening, g: int) -> tuple[float, float, float, float]:
    """A group's cost-model times in a profile's row (the backward halved for I and W)."""
    fwd, bwd = probe.graph.nodes[g]["fwd"], probe.graph.nodes[g]["bwd"]
    return (fwd, bwd, bwd / 2, bwd / 2)


def apply_profile(config, profile: CostProfile, probe: Coarsening, fine, split_backward: bool):
    """The partition config with measured node times and link parameters."""
    times = profile.node_times(fine, probe, split_backward)
    return dataclasses.replace(config, node_times=times, link=(profile.latency_s, profile.bandwidth_bytes_per_s))
