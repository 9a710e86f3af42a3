"""What the TP pass found and did: ``program.tensor_parallel``, and its report."""
from __future__ import annotations

import enum
import re
from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from fxpipe.ir.pass_configs import TPConfig
from fxpipe.ir.shard_spec import ShardKind, ShardSpec


class Comm(enum.Enum):
    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"


class CollectiveKind(enum.Enum):
    """A TP op inserted in the graph, with the communication of each direction."""
    F = "f"
    """Identity forward, all-reduce backward: before a column-parallel input (Megatron f)."""
    G = "g"
    """All-reduce forward, identity backward: after a row-parallel output (Megatron g)."""
    GATHER_SEQ = "gather_seq"
    """SP: all-gather forward, reduce-scatter backward (replaces f)."""
    REDUCE_SCATTER_SEQ = "reduce_scatter_seq"
    """SP: reduce-scatter forward, all-gather backward (replaces g)."""
    SCATTER = "scatter"
    """Keep own chunk forward, all-gather backward (replicated -> sharded)."""
    GATHER = "gather"
    """All-gather forward, keep own chunk backward (sharded -> replicated consumer)."""
    VOCAB_CROSS_ENTROPY = "vocab_parallel_cross_entropy"
    """All-reduce MAX, SUM, SUM forward; nothing backward (Megatron)."""

    @property
    def forward(self) -> tuple[Comm, ...]:
        return _FORWARD[self]

    @property
    def backward(self) -> tuple[Comm, ...]:
        return _BACKWARD[self]


_FORWARD = {
    CollectiveKind.F: (), CollectiveKind.G: (Comm.ALL_REDUCE,),
    CollectiveKind.GATHER_SEQ: (Comm.ALL_GATHER,),
    CollectiveKind.REDUCE_SCATTER_SEQ: (Comm.REDUCE_SCATTER,),
    CollectiveKind.SCATTER: (), CollectiveKind.GATHER: (Comm.ALL_GATHER,),
    CollectiveKind.VOCAB_CROSS_ENTROPY: (Comm.ALL_REDUCE,) * 3,
}
_BACKWARD = {
    CollectiveKind.F: (Comm.ALL_REDUCE,), CollectiveKind.G: (),
    CollectiveKind.GATHER_SEQ: (Comm.REDUCE_SCATTER,),
    CollectiveKind.REDUCE_SCATTER_SEQ: (Comm.ALL_GATHER,),
    CollectiveKind.SCATTER: (Comm.ALL_GATHER,), CollectiveKind.GATHER: (),
    CollectiveKind.VOCAB_CROSS_ENTROPY: (),
}


@dataclass(frozen=True)
class CollectiveSite:
    node: str
    """Graph node of the op."""
    kind: CollectiveKind
    layer: int | None
    """Repeated-layer index (None: outside the layers)."""
    purpose: str
    """What it serves, e.g. 'before column-parallel transformer.h.0.attn.c_attn'."""
    dim: int | None = None


class BlockKind(enum.Enum):
    ATTENTION = "attention"
    MLP = "mlp"
    LM_HEAD = "lm head"
    EMBEDDING = "embedding"


@dataclass(frozen=True)
class BlockInfo:
    """A Megatron block found in the graph."""
    kind: BlockKind
    layer: int | None
    column: tuple[str, ...]
    """Column-parallel (or vocab) weights, by original name."""
    row: tuple[str, ...]
    """Row-parallel weights, by original name."""
    detail: str
    """Heads / kv heads / FFN size / vocabulary, and per-rank counts."""


@dataclass(frozen=True)
class TPResult:
    config: TPConfig
    specs: Mapping[str, ShardSpec]
    """Canonical parameter/buffer name -> spec (replicated ones too, with a reason)."""
    blocks: tuple[BlockInfo, ...]
    collectives: tuple[CollectiveSite, ...]
    vocab_size: int | None = None
    padded_vocab: int | None = None
    sequence_dim: int | None = None
    """Dim of the residual stream split by sequence parallelism (None without sp)."""
    coverage: TPCoverage | None = None
    """Weight matrices left whole, and this rank's share of the parameters."""

    def sharded(self) -> list[ShardSpec]:
        return [s for s in self.specs.values() if s.kind is not ShardKind.REPLICATED]

    def replicated(self) -> list[ShardSpec]:
        return [s for s in self.specs.values() if s.kind is ShardKind.REPLICATED]

    def kind_of(self, name: str) -> ShardKind:
        """Placement of a parameter by any of its names (tied names included)."""
        for spec in self.specs.values():
            if name == spec.name or name in spec.members:
                return spec.kind
        raise KeyError(name)

    def comm_per_layer(self) -> dict[int | None, dict[str, Counter]]:
        """layer -> {'forward': Counter(Comm), 'backward': Counter(Comm)}."""
        out: dict[int | None, dict[str, Counter]] = {}
        for site in self.collectives:
            row = out.setdefault(site.layer, {"forward": Counter(), "backward": Counter()})
            row["forward"].update(site.kind.forward)
            row["backward"].update(site.kind.backward)
        return out


def render_sharding_report(result: TPResult) -> str:
    """The text ``fxpipe compile --tp T`` prints."""
    cfg = result.config
    lines = [f"tensor parallel: tp={cfg.tp}, sequence parallel {'on' if cfg.sp else 'off'}, "
             f"scatter-gather {'on' if cfg.scatter_gather else 'off'}"]
    if result.vocab_size is not None:
        lines.append(f"  vocabulary {result.vocab_size} -> padded {result.padded_vocab} "
                     f"({(result.padded_vocab or 0) // cfg.tp} rows per rank)")
    sharded, replicated = result.sharded(), result.replicated()
    lines.append(f"sharded parameters ({len(sharded)}):")
    width = max((len(s.name) for s in result.specs.values()), default=10)
    for s in sharded:
        ranks = "  ".join(f"r{r}{s.describe_ranges(r)}" for r in range(s.tp))
        tied = f"  (tied: {', '.join(s.members[1:])})" if len(s.members) > 1 else ""
        lines.append(f"  {s.name:<{width}}  {s.kind.value:<6} dim {s.dim}  "
                     f"{list(s.full_shape)} -> {list(s.local_shape)}  {ranks}{tied}")
    if result.coverage is not None:
        lines.append(f"parameter share per rank {result.coverage.share:.3f} (ideal {1 / cfg.tp:.3f})")
    lines.append(f"replicated parameters ({len(replicated)}):")
    for s in replicated:
        lines.append(f"  {s.name:<{width}}  {s.reason}")
    lines.append("blocks:")
    for b in result.blocks:
        where = "outside layers" if b.layer is None else f"layer {b.layer}"
        lines.append(f"  {where:<14} {b.kind.value:<9} {b.detail}")
    lines.append("collectives per layer (forward | backward):")
    for layer, row in sorted(result.comm_per_layer().items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        where = "outside layers" if layer is None else f"layer {layer}"
        lines.append(f"  {where:<14} {_counts(row['forward'])} | {_counts(row['backward'])}")
    return "\n".join(lines)


def _counts(c: Counter) -> str:
    if not c:
        return "none"
    return ", ".join(f"{n} {comm.value}" for comm, n in sorted(c.items(), key=lambda kv: kv[0].value))


TOP_REASONS = 3


@dataclass(frozen=True)
class TPCoverage:
    tp: int
    parameters: int
    """Trainable parameters of the whole model (tied groups once)."""
    local_parameters: int
    """Of those, how many this rank holds (padding rows included)."""
    whole: tuple[tuple[str, int, str], ...]
    """(name, numel, reason) of every weight matrix left whole on every rank."""

    @property
    def share(self) -> float:
        return self.local_parameters / self.parameters if self.parameters else 1.0

    @property
    def complete(self) -> bool:
        return not self.whole

    def reasons(self) -> list[tuple[int, str]]:
        """(count, reason) over the whole matrices, layer numbers and node names dropped."""
        counts = Counter(generic_reason(r) for _, _, r in self.whole)
        return [(n, r) for r, n in counts.most_common()]

    def describe(self) -> str:
        """One line: what stayed whole, the share against the ideal, the top reasons."""
        numel = sum(n for _, n, _ in self.whole)
        top = "; ".join(f"{n}× {r}" for n, r in self.reasons()[:TOP_REASONS])
        what = "weight matrix" if len(self.whole) == 1 else "weight matrices"
        return (f"tensor parallel: tp={self.tp} left {len(self.whole)} {what} "
                f"({_count(numel)} parameters) whole on every rank; this rank holds "
                f"{self.share:.2f} of the model's parameters (ideal {1 / self.tp:.2f}); "
                f"top reasons: {top}")


def generic_reason(reason: str) -> str:
    """A reason without layer numbers and graph node names, so that the same cause in
    every layer is counted once."""
    reason = re.sub(r"\.\d+\.", ".N.", reason)
    reason = re.sub(r"\blayer \d+", "layer N", reason)
    return re.sub(r" \(\w+\)", "", reason)


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
