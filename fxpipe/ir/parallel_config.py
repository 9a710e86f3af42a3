"""``ParallelConfig``: every choice of a parallel layout, decided once.

``fxpipe.parallelize``'s keyword arguments, ``fxpipe run``'s and ``fxpipe compile``'s
flags all become one frozen ``ParallelConfig``; the compile pipeline
(``fxpipe/compiler/pipeline.py``) and the runtime read it and nothing else. Names arrive as
strings (from a user or a flag) and are parsed into enums here, with an error that
lists the valid ones; derived defaults (``chunks`` from the schedule, scatter-gather
from tp and sp) are resolved here, so the report, the partition and the transport
cannot disagree about them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fxpipe.base.hardware import get_hardware
from fxpipe.base.precision import Precision
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.base.train_state import state_bytes
from fxpipe.ir.pass_configs import EPConfig, PartitionConfig, TPConfig
from fxpipe.partition.result import Method
from fxpipe.schedules.inflight import stage_inflight
from fxpipe.schedules.registry import ScheduleKind, generate, get_spec
from fxpipe.schedules.vocab_actions import add_vocab_passes


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """One rank's view of the layout and how to compile it (see the module docstring)."""
    tp: int = 1
    """Tensor-parallel size: ranks that split every sharded layer."""
    pp: int = 1
    """Pipeline-parallel size: ranks in one pipeline."""
    dp: int | None = None
    """Data-parallel replicas; None: world size / (tp·pp), resolved at launch (``with_world``)."""
    num_microbatches: int = 1
    """Microbatches m per step, per data-parallel replica. Its public keyword is
    ``microbatches=`` (``ParallelConfig(microbatches=8)``, ``parallelize(..., microbatches=8)``,
    ``--microbatches``): the one alias, mapped onto this field by ``__init__``."""
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    chunks: int | None = None
    """Stages per pipeline rank; None resolves to the schedule's default."""
    partition: Method = Method.ILP
    memory_limit_gb: float | None = None
    """GiB per rank the partition must fit (the ILP meets it or names the smallest that fits)."""
    precision: Precision = Precision.FP32
    recompute: RecomputeMode = RecomputeMode.NONE
    sp: bool = False
    """Sequence parallelism (Korthikanti et al. 2022); needs tp > 1."""
    scatter_gather: bool | None = None
    """SC21 §4.1: send 1/tp chunks of replicated stage outputs. None resolves to
    tp > 1 and not sp (with sp the boundary activation is already a sequence shard)."""
    strict_tp: bool = False
    """Fail (``ValueError`` naming them) when tensor parallelism leaves weight matrices whole."""
    zero: int = 0
    """1: ZeRO stage 1 over data parallel (``runtime/zero.py``)."""
    bucket_mb: float = 25.0
    """Data parallel: MB of gradients per bucket, each reduced as soon as the last backward
    finishes it, behind the rest of the backward (``runtime/grad_buckets.py``; torch DDP's
    ``bucket_cap_mb``). 0: one reduction after the last backward (nothing overlapped)."""
    ep: int = 1
    """Expert parallelism (``ir/pass_configs.py``): each grouped MoE's experts owned by
    ep consecutive data-parallel ranks, E/ep each, tokens exchanged by all-to-all; must
    divide dp. 1: every replica holds every expert."""
    costs: str = "measure"
    """What the partitioner balances: 'measure', 'model' or a cost profile's path (``fxpipe/costs``)."""
    split_loss: bool = False
    """Compute the cross-entropy over a split LM head block by block (``passes/split_loss.py``:
    vocabulary parallelism across pipeline stages). Off by default: it balances stages
    better but, measured end to end on CPU (HF GPT-2 8×256, pp=2, ``bench_runtime.py``),
    trains slower than the whole cross-entropy after finer head blocks (docs/costs.md)."""
    vocab_passes: bool = False
    """Run the LM head and its cross-entropy as vocabulary passes (``schedules/vocab_actions.py``,
    ``runtime/head_blocks.py``): each pipeline rank owns one block of the head's rows and
    computes its logits' softmax statistics (S) and gradients (T) for every microbatch. Under
    tp > 1 the blocks are of each TP rank's vocabulary shard (a V/(tp·pp) block per process)."""
    seed: int = 0
    timeout_s: float = 60.0
    """Bound on every transfer and collective."""
    inductor: bool = False
    """Compile each stage with AOTAutograd + TorchInductor (``runtime/compiled.py``)."""
    hardware: str = "cpu"
    """The cost model's hardware preset (``fxpipe/base/hardware.py``) when costs are not measured."""
    time_limit_s: float = 10.0
    """The ILP solver's time limit."""
    allow_over_limit: bool = False
    """Return a non-ILP plan over ``memory_limit_gb`` instead of failing (comparison tables)."""

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        fix("schedule", ScheduleKind.parse(self.schedule))
        fix("partition", Method.parse(self.partition))
        fix("precision", Precision.parse(self.precision))
        fix("recompute", self.recompute if isinstance(self.recompute, RecomputeMode)
            else RecomputeMode.parse(self.recompute))
        check_layout({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        fix("costs", parse_costs(self.costs))
        spec = get_spec(self.schedule)
        fix("chunks", spec.default_chunks if self.chunks is None else self.chunks)
        fix("scatter_gather", self.tp > 1 and (not self.sp if self.scatter_gather is None
                                                else bool(self.scatter_gather)))
        if self.ep > 1:
            self.expert_parallel  # ep against dp, when dp is given  # noqa: B018

    # ---- derived -------------------------------------------------------------------------
    def with_world(self, world_size: int) -> "ParallelConfig":
        """``dp`` resolved against the number of processes (a mismatch is an error)."""
        return dataclasses.replace(self, dp=resolve_dp(world_size, self.tp, self.pp, self.dp))

    @property
    def replicas(self) -> int:
        """Data-parallel replicas (1 before ``with_world`` when dp was left to the world)."""
        return self.dp or 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def memory_limit_bytes(self) -> int | None:
        return None if self.memory_limit_gb is None else int(self.memory_limit_gb * 2**30)

    @property
    def tensor_parallel(self) -> TPConfig:
        """The tensor-parallel pass's view (``ir/pass_configs.py``)."""
        return TPConfig(tp=self.tp, sp=self.sp, scatter_gather=self.scatter_gather, strict=self.strict_tp)

    @property
    def expert_parallel(self) -> EPConfig:
        """The expert-parallel pass's view (``ir/pass_configs.py``); checks that ep divides dp."""
        return EPConfig(ep=self.ep, dp=self.replicas if self.dp is not None else self.ep)

    @property
    def balances_time(self) -> bool:
        """Whether the partition optimises stage times (ILP, chain DP) rather than counts."""
        return self.num_stages > 1 and self.partition in (Method.ILP, Method.DP)

    @property
    def gathers_behind_forward(self) -> bool:
        """ZeRO-1's updated weights each waited for at its first reader inside the stage
        graphs (``runtime/param_waits.py``), so their gather runs behind the first forward;
        not where the vocabulary passes' head blocks read the LM head outside the graphs,
        nor where Inductor compiles the stages (opaque graphs). The runtime and the price
        (``planner/layout_price.py``) both read it."""
        return bool(self.zero) and not self.inductor and not self.vocab_passes

    def schedule_ir(self):
        """The compute-only schedule (``fxpipe/schedules``) of this layout; under vocabulary
        passes with them at unit times, what the partition is solved for (the compiler
        re-places them on the stages' costs after the split: ``fxpipe/compiler/vocab_placement.py``)."""
        schedule = generate(self.schedule, self.pp, self.num_microbatches, self.chunks)
        if self.vocab_passes:
            schedule = add_vocab_passes(schedule)
        return schedule

    def partition_config(self, schedule) -> PartitionConfig:
        """The partition pass's config for ``schedule`` (this config's schedule_ir())."""
        return PartitionConfig(num_stages=schedule.num_stages, stage_to_rank=schedule.stage_ranks,
                               inflight=stage_inflight(schedule), method=self.partition,
                               memory_limit_bytes=self.memory_limit_bytes, hardware=get_hardware(self.hardware),
                               time_limit_s=self.time_limit_s, allow_over_limit=self.allow_over_limit,
                               state_bytes_per_param_byte=self.state_bytes_per_param_byte,
                               recompute=self.recompute, recompute_runs=2 if schedule.splits_backward else 1)

    @property
    def state_bytes_per_param_byte(self) -> float:
        """Training state per byte of parameter, as the partition's memory model counts it:
        the parameter, its gradient and Adam's two moments — under ZeRO-1 the moments
        split over the dp replicas (``runtime/zero.py``: whole parameters per owner,
        balanced by size, so about 1/dp each)."""
        # Per 4-byte fp32 parameter: weight 4, gradient 4, Adam's moments 8 (base/train_state.py).
        return sum(state_bytes(4.0, 4.0, 16.0, zero=bool(self.zero), dp=self.replicas)) / 4.0


def _setting(field: str, value: Any, flag: Callable[[str], str] | None) -> str:
    """``field=value`` for the API; for the CLI the flag as given (``--tp 2``, ``--inductor``)."""
    value = value.value if isinstance(value, RecomputeMode) else value
    if flag is None:
        return f"{field}={value}"
    if isinstance(value, bool):
        return flag(field) if value else f"no {flag(field)}"
    return f"{flag(field)} {value}"


def check_layout(values: Mapping[str, Any], *, flag: Callable[[str], str] | None = None) -> None:
    """The layout's own rules, in one place: ``ParallelConfig`` checks its fields with them,
    ``fxpipe run``'s preflight its flags and config file before any config exists (``flag``:
    a field's flag, ``--tp``, which every message then names instead of the field).
    ``values`` by field name; a field that is absent is not checked."""
    flags = flag is not None
    name = flag or (lambda field: field)
    on = flag or (lambda field: f"{field}=True")  # a switch, set
    get = values.get
    for field in ("tp", "pp", "num_microbatches"):
        value = get(field, 1)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name('microbatches' if field == 'num_microbatches' and not flags else field)} must be "
                            f"an integer, got {value!r} ({type(value).__name__})")
        if value < 1:
            raise ValueError(f"{name(field)} must be >= 1, got {value!r}")
    dp = get("dp")
    if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool)):
        raise TypeError(f"{name('dp')} must be an integer or None (world / (tp·pp)), got {dp!r} ({type(dp).__name__})")
    if dp is not None and dp < 1:
        raise ValueError(f"{name('dp')} must be >= 1, got {dp!r}" if flags else
                         f"dp must be a positive integer or None (world / (tp·pp)), got {dp!r}")
    tp, pp, ep = get("tp", 1), get("pp", 1), get("ep", 1)
    bucket_mb = get("bucket_mb", 0.0)
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb >= 0:
        raise ValueError(f"{name('bucket_mb')} must be a number of MB >= 0 (0: no overlap), got {bucket_mb!r}")
    if flags and "partition" in values:  # ParallelConfig parses it first, by its field's name
        try:
            Method.parse(values["partition"])
        except ValueError:
            raise ValueError(f"unknown --partition {values['partition']!r}; valid: "
                             f"{', '.join(m.value for m in Method)}") from None
    if get("sp") and tp == 1:
        raise ValueError(f"{on('sp')} needs {name('tp')} > 1: sequence parallelism splits the sequence over "
                         "the tensor-parallel group")
    if get("zero", 0) not in (0, 1):
        raise ValueError(f"{name('zero')} must be 0 (off) or 1 (optimizer state and fp32 masters sharded over "
                         f"data parallel), got {get('zero')}")
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"{name('ep')} must be a positive integer (data-parallel ranks sharing the experts), "
                         f"got {ep!r}")
    if ep > 1 and isinstance(dp, int) and dp % ep:  # an expert group is ep consecutive dp ranks
        raise ValueError(f"{_setting('ep', ep, flag)} does not divide {_setting('dp', dp, flag)}: the experts are "
                         f"owned by data-parallel ranks, choose {name('ep')} among "
                         f"{[d for d in range(1, dp + 1) if dp % d == 0]}")
    if ep > 1:
        # compile: Inductor would trace the dispatch's all-to-all with fake tensors;
        # recompute: a recomputed dispatch would count its tokens twice.
        for field, ok in (("tp", 1), ("zero", 0), ("inductor", False), ("recompute", RecomputeMode.NONE)):
            value = get(field, ok)
            if field == "recompute" and not isinstance(value, RecomputeMode):
                value = RecomputeMode.parse(value)
            if value != ok:
                raise ValueError(f"{_setting('ep', ep, flag)} with {_setting(field, value, flag)} is not built yet: "
                                 f"expert parallelism runs with {_setting(field, ok, flag)}; use "
                                 f"{_setting('ep', 1, flag)} to combine {name(field)} with a MoE")
    timeout = get("timeout_s", 60.0)
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{name('timeout_s') if flags else 'timeout'} must be a positive number of seconds, "
                         f"got {timeout}; it bounds every transfer and collective (default 60)")
    limit = get("memory_limit_gb")
    # Finite and below any device (2^20 GiB): inf or 1e300 overflowed the search's integer bytes.
    if limit is not None and not 0 < limit <= MAX_MEMORY_LIMIT_GB:
        raise ValueError(f"{name('memory_limit_gb')} must be a number of GiB per rank in (0, {MAX_MEMORY_LIMIT_GB:,}], "
                         f"got {limit}; leave it out for no limit")
    spec = get_spec(ScheduleKind.parse(get("schedule", ScheduleKind.ONE_F_ONE_B)))
    chunks = spec.default_chunks if get("chunks") is None else get("chunks")
    # Flags: the preflight generates the schedule itself, whose generator names the rule.
    if not flags and (not isinstance(chunks, int) or chunks < 1
                      or (spec.chunks is not None and chunks not in spec.chunks)):
        allowed = "any >= 1" if spec.chunks is None else ", ".join(map(str, spec.chunks))
        raise ValueError(f"schedule {spec.name} takes {name('chunks')} (stages per rank) {allowed}, got {chunks!r}")
    if get("vocab_passes"):
        # One-line refusals where the passes cannot apply (the model's head is checked
        # by the compiler, passes/vocab_head.py).
        for bad, why in ((pp < 2, f"pp={pp}: they split the head over pipeline ranks, use pp >= 2"),
                         (get("split_loss"), "split_loss=True: both split the head; pick one"),
                         (get("inductor"), "inductor=True: the head's blocks run eagerly; use inductor=False"),
                         (ep > 1, f"ep={ep}: not built with expert parallelism, use ep=1")):
            if bad:
                raise ValueError(f"{on('vocab_passes')} with {why}")


MAX_MEMORY_LIMIT_GB = 2**20
"""1 PiB per rank: above any device; a larger limit means none."""

_dataclass_init = ParallelConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *, microbatches: int | None = None, **fields) -> None:
    # ``microbatches=`` is the documented keyword; inside, the count is ``num_microbatches``
    # (dataclasses.replace passes both: the keyword given wins over the copied field).
    if microbatches is not None:
        fields["num_microbatches"] = microbatches
    _dataclass_init(self, **fields)


ParallelConfig.__init__ = _init  # type: ignore[method-assign]


def parse_costs(costs) -> str:
    """'measure', 'model' or the path of an existing profile; anything else is an error
    naming the choices."""
    if isinstance(costs, os.PathLike):
        costs = os.fspath(costs)
    if isinstance(costs, str) and (costs in ("measure", "model") or os.path.isfile(costs)):
        return costs
    raise ValueError(f"costs must be 'measure', 'model' or the path of a cost profile file, got {costs!r}"
                     + (" (no such file)" if isinstance(costs, str) else ""))


def resolve_dp(world_size: int, tp: int, pp: int, dp: int | None) -> int:
    """dp defaults to world_size / (tp·pp); any mismatch is a user error."""
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp·pp = {tp}·{pp} = {tp * pp}; "
                         f"launch a multiple of {tp * pp} processes or change tp/pp")
    implied = world_size // (tp * pp)
    if dp is not None and dp != implied:
        raise ValueError(f"tp·pp·dp = {tp}·{pp}·{dp} = {tp * pp * dp} but the world has {world_size} "
                         f"processes; use dp={implied} or launch {tp * pp * dp} processes")
    return implied
