"""A cost profile: measured seconds per probe group and per link, and what they fit.

The profile is keyed by everything its numbers depend on — the graph after the
tensor-parallel rewrite, the microbatch shapes and dtypes, the probe groups, the
device, the mesh, torch's version and thread count — so a cached profile is used
only for the run it was measured for. Files are untrusted input: parsed as strict
JSON under a size cap, every field type-checked, a digest over the content.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import networkx as nx
import torch

from fxpipe.base.safe_io import UnsafeFileError, read_bounded
from fxpipe.costs.measure import PHASES
from fxpipe.partition import Coarsening

FORMAT = 2
"""2: group times net of the stage runner's fixed cost (``measure.runner_fixed_cost``);
profiles of format 1 hold it in every group and are measured again."""
MAX_BYTES = 16 * 2**20


class ProfileError(ValueError):
    """A cost profile that cannot be used for this run (another device, graph or layout)."""


def device_name(device: torch.device) -> str:
    """What the timings depend on: the accelerator's model, or the CPU's and the threads."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu:{cpu} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def profile_key(program, coarsening: Coarsening, device: str, mesh: Sequence[int]) -> str:
    """SHA-256 over what the numbers depend on (module docstring)."""
    gm = program.graph_module
    params = sorted((p.name, tuple(p.shape), str(p.dtype)) for p in program.params)
    blob = json.dumps(dict(
        format=FORMAT, code=gm.code, inputs=[(tuple(s.shape), str(s.dtype)) for s in program.input_specs],
        vals=[(n.name, str(tuple(n.meta["val"].shape)) if isinstance(n.meta.get("val"), torch.Tensor) else "")
              for n in gm.graph.nodes],
        params=params, groups=[list(map(str, m)) for m in coarsening.members], device=device,
        mesh=list(mesh), torch=torch.__version__), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class CostProfile:
    key: str
    device: str
    groups: tuple[tuple[float, float, float, float], ...]
    """Per probe group: (fwd, bwd, input, weight) median seconds."""
    latency_s: float
    """One point-to-point transfer's fixed cost (0 without pipeline peers)."""
    bandwidth_bytes_per_s: float
    """Point-to-point bandwidth (inf without pipeline peers)."""

    def node_times(self, fine: nx.DiGraph, coarsening: Coarsening,
                   split_backward: bool) -> dict[Any, tuple[float, float]]:
        """(fwd, bwd) seconds per fine node: each group's measured time shared among its
        members in proportion to the cost model's estimate (evenly where it has none).
        ``split_backward``: bwd is I + W as the zero-bubble schedules run it."""
        times: dict[Any, tuple[float, float]] = {}
        for g, members in enumerate(coarsening.members):
            fwd, bwd, inp, wgt = self.groups[g]
            back = inp + wgt if split_backward else bwd
            for key, total in (("fwd", fwd), ("bwd", back)):
                model = [fine.nodes[n][key] for n in members]
                norm = sum(model)
                for n, m in zip(members, model):
                    share = m / norm if norm > 0 else 1 / len(members)
                    prev = times.get(n, (0.0, 0.0))
                    times[n] = (total * share, prev[1]) if key == "fwd" else (prev[0], total * share)
        return times

    # ---- files ---------------------------------------------------------------------------
    def _payload(self) -> dict:
        return dict(format=FORMAT, key=self.key, device=self.device, groups=[list(g) for g in self.groups],
                    latency_s=self.latency_s,
                    bandwidth_bytes_per_s=None if math.isinf(self.bandwidth_bytes_per_s) else self.bandwidth_bytes_per_s)

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        payload = self._payload()
        body = json.dumps(payload, sort_keys=True)
        doc = dict(payload, sha256=hashlib.sha256(body.encode()).hexdigest())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
        return path

    @staticmethod
    def load(path: str | os.PathLike) -> "CostProfile":
        """Parse and check a profile file; ProfileError says what is wrong with it."""
        path = Path(path)
        try:  # a regular file under the cap: a FIFO or /dev/zero is refused at once (fxpipe/base/safe_io.py)
            doc = json.loads(read_bounded(path, MAX_BYTES), parse_constant=_refuse_constant)
        except UnsafeFileError as e:
            raise ProfileError(f"not a readable cost profile: {e}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ProfileError(f"{path}: not a readable cost profile ({e})") from None
        return _parse(doc, path)


def _refuse_constant(name: str):
    raise ProfileError(f"non-finite number {name} in a cost profile")


def _number(v: Any, where: str, path: Path, *, allow_none: bool = False) -> float:
    if v is None and allow_none:
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ProfileError(f"{path}: {where} must be a finite number >= 0, got {v!r}")
    return float(v)


def _parse(doc: Any, path: Path) -> CostProfile:
    fields = {"format", "key", "device", "groups", "latency_s", "bandwidth_bytes_per_s", "sha256"}
    if not isinstance(doc, dict) or set(doc) != fields:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ProfileError(f"{path}: expected the fields {sorted(fields)}, got {got}")
    if doc["format"] != FORMAT:
        raise ProfileError(f"{path}: profile format {doc['format']!r}, this fxpipe reads {FORMAT}")
    for name in ("key", "device", "sha256"):
        if not isinstance(doc[name], str) or len(doc[name]) > 4096:
            raise ProfileError(f"{path}: {name} must be a string")
    body = json.dumps({k: v for k, v in doc.items() if k != "sha256"}, sort_keys=True)
    if hashlib.sha256(body.encode()).hexdigest() != doc["sha256"]:
        raise ProfileError(f"{path}: content does not match its sha256 (edited or corrupt)")
    groups = doc["groups"]
    if not isinstance(groups, list) or not groups:
        raise ProfileError(f"{path}: groups must be a non-empty list")
    parsed = []
    for i, g in enumerate(groups):
        if not isinstance(g, list) or len(g) != len(PHASES):
            raise ProfileError(f"{path}: group {i} must list {len(PHASES)} times {PHASES}")
        parsed.append(tuple(_number(v, f"group {i} {p}", path) for v, p in zip(g, PHASES)))
    return CostProfile(key=doc["key"], device=doc["device"], groups=tuple(parsed),
                       latency_s=_number(doc["latency_s"], "latency_s", path),
                       bandwidth_bytes_per_s=_number(doc["bandwidth_bytes_per_s"], "bandwidth_bytes_per_s",
                                                     path, allow_none=True))


def cache_dir() -> Path:
    """``$FXPIPE_CACHE_DIR``, else ``~/.cache/fxpipe``."""
    return Path(os.environ.get("FXPIPE_CACHE_DIR") or Path.home() / ".cache" / "fxpipe")


def cache_path(key: str) -> Path:
    return cache_dir() / "costs" / f"{key[:40]}.json"


def check_usable(profile: CostProfile, key: str, device: str, num_groups: int, source: str) -> None:
    """Raise ProfileError unless ``profile`` was measured for this graph on this device."""
    if profile.device != device:
        raise ProfileError(f"{source} was measured on {profile.device!r}; this rank's device is "
                           f"{device!r}. Costs do not transfer between devices: measure here with "
                           f"costs='measure' (fxpipe --costs measure)")
    if profile.key != key or len(profile.groups) != num_groups:
        raise ProfileError(f"{source} was measured for another graph, batch shape or layout (key "
                           f"{profile.key[:12]}…, this run's is {key[:12]}…); measure it with "
                           f"costs='measure'")


MAX_GROUP_S = 3600.0
"""No probe group takes an hour for one microbatch: a profile saying so is not a measurement."""
MAX_RATIO = 1000.0
"""How far one group's measured / modelled time may stray from the profile's median ratio."""
FLOOR_S = 1e-4
"""Modelled times are compared from this floor up: a group the model prices at nanoseconds
still pays the runner's fixed cost of tens of microseconds when measured."""


def check_plausible(profile: CostProfile, probe: Coarsening, source: str) -> None:
    """Raise ProfileError for a profile whose times no measurement gives: a group over
    ``MAX_GROUP_S``, or one whose measured / modelled ratio (the cost model's time of
    each of ``probe``'s groups) is ``MAX_RATIO`` times the profile's median ratio either
    way (the cost model's scale differs between devices; its shape over the graph does not)."""
    modelled = [(probe.graph.nodes[g]["fwd"], probe.graph.nodes[g]["bwd"]) for g in range(len(probe.members))]
    for g, times in enumerate(profile.groups):
        for phase, t in zip(PHASES, times):
            if t > MAX_GROUP_S:
                raise ProfileError(f"{source}: group {g}'s {phase} time is {t:.3g} s for one microbatch, over "
                                   f"{MAX_GROUP_S:.0f} s: not a measurement; measure with costs='measure'")
    ratios = [(g, phase, t / max(m, FLOOR_S)) for g, (times, model) in enumerate(zip(profile.groups, modelled))
              for phase, t, m in (("fwd", times[0], model[0]), ("bwd", times[1], model[1])) if t > 0]
    if not ratios:
        return
    median = statistics.median(r for _, _, r in ratios)
    for g, phase, r in ratios:
        if not median / MAX_RATIO <= r <= median * MAX_RATIO:
            raise ProfileError(f"{source}: group {g}'s {phase} time is {r / median:.3g}x what the rest of the profile "
                               f"implies for it (measured / modelled against the median), beyond {MAX_RATIO:.0f}x "
                               f"either way: not a measurement of this graph; measure with costs='measure'")
