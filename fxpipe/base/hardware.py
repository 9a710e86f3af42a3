"""Hardware models: turn FLOPs, bytes and collectives into seconds.

A small roofline per kernel plus ring collectives over two link classes:

- a matrix multiply takes max(FLOPs / (peak · matmul_efficiency), bytes / memory
  bandwidth) — compute bound for large GEMMs, memory bound for thin ones (the
  attention bmm of a small head dimension);
- an element-wise kernel takes its bytes / (peak bandwidth · memory_efficiency);
- every kernel pays ``op_overhead_s`` (launch, or eager dispatch on a CPU);
- a ring collective of S bytes over n ranks takes 2(n−1)/n·S/bw + 2(n−1)·latency
  (all-reduce) or (n−1)/n·S/bw + (n−1)·latency (all-gather, reduce-scatter), with
  NVLink's bus bandwidth inside a node; a group spanning nodes with k members per
  node drives k NICs at once (NCCL runs one ring per NIC), so its bandwidth is
  min(NVLink, k · NIC).

The presets (``presets/*.json``, the format ``fxpipe calibrate`` writes) name the source of
each number; their efficiencies are assumptions with the reason written there.
``fxpipe calibrate`` measures this machine instead (``Hardware.load``).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxpipe.base.op_cost import NodeCost
from fxpipe.base.safe_io import read_json_object


class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    """One rank's tensor to all: a pipelined ring moves the whole tensor over each link once."""
    REDUCE = "reduce"
    """All ranks' tensors summed onto one: the broadcast's ring, reversed."""
    ALL_TO_ALL = "all_to_all"
    """Each rank's tensor cut in ``size`` parts, part r to rank r: (size-1)/size of it leaves
    every rank, in size-1 exchanges (the all-gather's bytes and steps)."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """One class of interconnect, seen from one device."""

    p2p_bw: float
    """Bytes/s one device sends to one peer (one direction)."""
    p2p_latency: float
    """Seconds per point-to-point message, on top of bytes / p2p_bw."""
    collective_bw: float
    """Ring bus bandwidth per device, bytes/s (nccl-tests' "busbw"): a ring all-reduce of
    S bytes over n ranks moves 2(n−1)/n·S per rank at this rate."""
    collective_latency: float
    """Seconds per ring step (an all-reduce has 2(n−1) steps)."""

    def __post_init__(self) -> None:
        for f in ("p2p_bw", "collective_bw"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Link.{f} must be > 0 bytes/s, got {getattr(self, f)}")


BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    """Preset name, or the profile's name for a measured machine."""
    peak_flops: float
    """Datasheet dense matmul FLOP/s of one device (fp16/bf16 tensor cores; a CPU profile
    stores the measured fp32 rate here)."""
    matmul_efficiency: float
    """Fraction of ``peak_flops`` a large GEMM sustains."""
    peak_memory_bw: float
    """Datasheet memory bandwidth, bytes/s."""
    memory_efficiency: float
    """Fraction of ``peak_memory_bw`` element-wise kernels reach."""
    attention_efficiency: float = 1.0
    """A fused (flash) attention kernel's FLOP rate as a fraction of ``matmul_flops``
    (FLOPs counted over the full s×s, as the paper counts them)."""
    memory_bytes: int
    """Device memory per accelerator."""
    usable_memory_fraction: float = 0.9
    """Share of ``memory_bytes`` a plan may fill; the rest covers the CUDA context,
    library workspaces and allocator fragmentation, which the planner does not model."""
    gpus_per_node: int = 8
    """Devices that share the fast intra-node link (NVLink/NVSwitch)."""
    intra_node: Link
    """Links between devices of one node."""
    inter_node: Link
    """Per-device links between nodes (one NIC per GPU on DGX A100/H100)."""
    op_overhead_s: float = 0.0
    """Seconds every kernel pays regardless of size: launch latency on a GPU; on a calibrated
    CPU, eager dispatch plus fxpipe's fx + autograd bookkeeping per op."""
    action_overhead_s: float = 0.0
    """Seconds the runtime pays per compute action regardless of its size (a forward or
    backward of one microbatch on one stage, a vocabulary pass): the executor, the stage
    runner and autograd's call. ``fxpipe calibrate`` measures it (``measure_action_overhead``);
    the layout search adds it to every action it simulates."""
    optimizer_tensor_s: float = 0.0
    """Seconds the optimizer step pays per parameter tensor regardless of its size: torch's
    AdamW on a CPU runs a dozen kernels for each tensor in turn (~0.1 ms a tensor on a
    core of the 2-core VM, where a small model's bytes cost far less); fused multi-tensor
    kernels on a GPU make it ~0. ``fxpipe calibrate`` measures it
    (``measure_optimizer_tensor``)."""
    transfer_cpu_s: float = 0.0
    """Seconds of a rank's own time each end of a point-to-point transfer takes besides
    moving its bytes: gloo posts a send or a receive on the calling thread (~0.1 ms alone
    on a core of the 2-core VM, and now and then milliseconds inside a pipeline, behind
    its transport thread), so a pipeline rank pays it for every activation and gradient
    it sends or receives, between its computations; NCCL only enqueues it (µs). ``fxpipe
    calibrate`` measures its mean inside a tiny pipeline (``transfer_speeds.pipeline_posts``);
    the layout search adds it to the actions that send or receive."""
    backend: str = "nccl"
    """The collective library the runtime uses on this hardware: ``nccl`` (GPUs) or ``gloo``
    (CPUs). Under gloo ZeRO-1's gradient reduction is an all-reduce, not a reduce-scatter
    (``runtime/grad_buckets.py``: gloo has no ring reduce), and is priced so."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"Hardware.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for f in ("matmul_efficiency", "memory_efficiency", "attention_efficiency", "usable_memory_fraction"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"Hardware.{f} must be in (0, 1], got {v}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        # A profile is a file from disk: an overhead that is negative, NaN or absurd would
        # silently reorder every layout the search prices.
        for f in ("action_overhead_s", "optimizer_tensor_s", "transfer_cpu_s"):
            if not 0 <= getattr(self, f) < 1:
                raise ValueError(f"Hardware.{f} must be in [0, 1) seconds, got {getattr(self, f)}")

    # ---- rates -------------------------------------------------------------------------
    @property
    def matmul_flops(self) -> float:
        """Achievable dense matmul FLOP/s (peak × efficiency)."""
        return self.peak_flops * self.matmul_efficiency

    @property
    def memory_bw(self) -> float:
        """Achievable memory bandwidth, bytes/s."""
        return self.peak_memory_bw * self.memory_efficiency

    @property
    def p2p_bw(self) -> float:
        """Point-to-point bandwidth between pipeline stages on different nodes."""
        return self.inter_node.p2p_bw

    @property
    def p2p_latency(self) -> float:
        return self.inter_node.p2p_latency

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    # ---- kernels -----------------------------------------------------------------------
    def gemm_s(self, m: int, n: int, k: int, *, batch: int = 1, dtype_bytes: int = 2) -> float:
        """Roofline time of ``batch`` (m×k)·(k×n) products: 2·m·n·k FLOPs each, reading
        both operands and writing the result once."""
        flops = 2.0 * m * n * k * batch
        traffic = float(dtype_bytes) * batch * (m * k + k * n + m * n)
        return max(flops / self.matmul_flops, traffic / self.memory_bw) + self.op_overhead_s

    def memory_s(self, nbytes: float, kernels: int = 1) -> float:
        """Time of memory-bound kernels moving ``nbytes`` in all."""
        return nbytes / self.memory_bw + kernels * self.op_overhead_s

    def forward_s(self, c: "NodeCost") -> float:
        """One graph node's forward: its matmul FLOPs or its bytes, and one kernel's
        overhead where it runs a kernel (a view or a ``getitem`` moves no bytes and runs
        none), as ``gemm_s`` and ``memory_s`` count it for the planner's layers."""
        kernel = self.op_overhead_s if c.fwd_flops or c.mem_bytes else 0.0
        return c.fwd_flops / self.matmul_flops + (0 if c.fwd_flops else c.mem_bytes / self.memory_bw) + kernel

    def backward_s(self, c: "NodeCost") -> float:
        # Element-wise backward reads the saved input and the output gradient and
        # writes the input gradient: about twice the forward traffic, in one kernel; a
        # matmul's backward is two products (input and weight gradients).
        kernels = 2 if c.fwd_flops else (1 if c.mem_bytes else 0)
        return (c.bwd_flops / self.matmul_flops + (0 if c.fwd_flops else 2 * c.mem_bytes / self.memory_bw)
                + kernels * self.op_overhead_s)

    # ---- communication -----------------------------------------------------------------
    def members_per_node(self, size: int, stride: int) -> int:
        """Members of a group of ``size`` ranks spaced ``stride`` apart (Megatron's rank
        layout: tp innermost, then dp, then pp) that share one node."""
        if stride >= self.gpus_per_node:
            return 1
        return max(1, min(size, self.gpus_per_node // stride))

    def collective_s(self, kind: Collective, nbytes: float, size: int, per_node: int) -> float:
        """Ring ``kind`` of a ``nbytes`` tensor (the full, gathered size) over ``size``
        ranks, ``per_node`` of them on each node."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        if per_node >= size:  # the whole group inside one node
            bw, lat = self.intra_node.collective_bw, self.intra_node.collective_latency
        else:
            bw = min(self.intra_node.collective_bw, per_node * self.inter_node.collective_bw)
            lat = self.inter_node.collective_latency
        steps = size - 1
        share = (size - 1) / size * nbytes
        if kind is Collective.ALL_REDUCE:  # reduce-scatter then all-gather
            steps, share = 2 * steps, 2 * share
        elif kind in (Collective.BROADCAST, Collective.REDUCE):  # NCCL: bus bandwidth = algorithm bandwidth
            share = nbytes
        return share / bw + steps * lat

    def p2p_s(self, nbytes: float, *, intra_node: bool) -> float:
        link = self.intra_node if intra_node else self.inter_node
        return nbytes / link.p2p_bw + link.p2p_latency if nbytes > 0 else 0.0

    # ---- profiles ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Hardware":
        d = dict(d)
        d.pop("measurements", None)
        d.pop("sources", None)  # the presets name theirs (fxpipe/base/presets/)
        fields = {f.name for f in dataclasses.fields(Hardware)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown hardware profile keys {sorted(unknown)}; valid: {sorted(fields)}")
        for key in ("intra_node", "inter_node"):
            d[key] = Link(**d[key])
        return Hardware(**d)

    def save(self, path: str, measurements: dict[str, Any] | None = None) -> None:
        data = self.to_dict()
        if measurements:
            data["measurements"] = measurements
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")

    @staticmethod
    def load(path: str) -> "Hardware":
        """A profile file: a regular file of at most ``MAX_PROFILE_BYTES`` (``/dev/zero`` or a
        FIFO named by mistake is refused at once, not read until memory runs out)."""
        return Hardware.from_dict(read_json_object(path, MAX_PROFILE_BYTES))


GB = 1e9
GiB = 2**30
MAX_PROFILE_BYTES = 1 << 20
"""A hardware profile larger than this is refused unread (one is a few hundred bytes)."""

PRESET_DIR = Path(__file__).parent / "presets"
"""The presets are profiles in the format ``fxpipe calibrate`` writes (``Hardware.save``),
one JSON file each, with a ``sources`` entry naming where every number comes from
(datasheets; the efficiencies are assumptions whose reasons are written there, not
fitted to any benchmark row)."""


def preset_sources(name: str) -> dict[str, str]:
    """Where each number of preset ``name`` comes from (its file's ``sources``)."""
    return dict(read_json_object(PRESET_DIR / f"{name}.json", MAX_PROFILE_BYTES).get("sources", {}))


A100 = Hardware.load(str(PRESET_DIR / "a100.json"))
"""DGX A100 (80 GB), the SC21 paper's machine (Selene)."""
V100 = Hardware.load(str(PRESET_DIR / "v100.json"))
H100 = Hardware.load(str(PRESET_DIR / "h100.json"))
H200 = Hardware.load(str(PRESET_DIR / "h200.json"))
CPU = Hardware.load(str(PRESET_DIR / "cpu.json"))
"""A 2-core CPU over gloo/loopback: rough figures; ``fxpipe calibrate`` measures the real ones."""

PRESETS = {h.name: h for h in (A100, V100, H100, H200, CPU)}


def get_hardware(name: str) -> Hardware:
    """A preset by name (a100, v100, h100, h200, cpu) or a JSON profile by path
    (``fxpipe calibrate --output PATH`` writes one)."""
    if name in PRESETS:
        return PRESETS[name]
    if os.path.exists(name):
        return Hardware.load(name)
    raise ValueError(f"unknown hardware {name!r}; valid: {', '.join(PRESETS)}, or the path of a "
                     f"profile written by `fxpipe calibrate`")
