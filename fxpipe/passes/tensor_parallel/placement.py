"""Parameter placements: a ShardSpec per parameter, from the roles of the ops that read it.

Every use of a parameter proposes a placement (the weight of a column-parallel
projection: its output channels; a vocabulary-parallel lookup: vocabulary
blocks; anything else: replicated). Tied names are one tensor, so all uses of
all their names must agree; when they do not, the lookup gives way (it stays
replicated) or the projection's channels are replicated in another round.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.shard_spec import ShardKind, ShardSpec, ranges_of
from fxpipe.ir.tp_result import BlockInfo, BlockKind
from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.assign import ALL, Assignment
from fxpipe.passes.tensor_parallel.attention_forms import split_shared
from fxpipe.passes.tensor_parallel.layout import LayoutFailure
from fxpipe.passes.tensor_parallel.plan_record import TPPlan
from fxpipe.passes.tensor_parallel.provenance import Provenance


@dataclass(frozen=True)
class _Proposal:
    kind: ShardKind
    dim: int | None
    ranges: tuple
    local: int
    reason: str
    origin: str
    """Node whose role makes this proposal."""


def vocab_ranges(rows: int, tp: int) -> tuple[tuple, int]:
    block = math.ceil(rows / tp)
    return tuple(ranges_of(range(r * block, min((r + 1) * block, rows))) for r in range(tp)), block


class _Specs:
    def __init__(self, program: Program, prov: Provenance, asg: Assignment, plan: TPPlan,
                 describe: Callable[[str], str]) -> None:
        self.program, self.prov, self.asg, self.plan, self.describe = program, prov, asg, plan, describe
        self.tp = plan.tp
        self.by_node = {p.node: p for p in program.params}
        self.props: dict[str, list[_Proposal]] = {}
        self.nodes = {n.name: n for n in program.graph.nodes}
        self.queries = np.concatenate([u.q.ravel() for u in prov.attention.values()]
                                      or [np.zeros(0, dtype=np.int64)])
        products = {G.EINSUM, *G.BATCHED_MATMULS}  # an operand the other's heads all read
        self.broadcast = np.concatenate([ids for ids, node in prov.broadcast_whole
                                         if self.nodes[node].target in products]
                                        or [np.zeros(0, dtype=np.int64)])

    def propose(self, placeholder: str, p: _Proposal) -> None:
        self.props.setdefault(self.by_node[placeholder].canonical, []).append(p)

    def column(self, name: str) -> None:
        proj = self.plan.column[name]
        first, count = self.prov.sources[name]
        ids = np.arange(first, first + count)
        own = self.asg.owner(ids)
        blocks = self.asg.block_of_label[self.asg.labels[ids[own != ALL]]]
        if blocks.size and blocks.min() > 0:
            kind, local = ShardKind.VOCAB, int(blocks.max())
            ranges = tuple(ranges_of(np.flatnonzero(own == r)) for r in range(self.tp))
            reason = "vocab-parallel LM head (cross-entropy over vocabulary shards)"
        else:
            kind = ShardKind.COLUMN
            shared = own == ALL
            held = [np.flatnonzero((own == r) | (own == ALL)) for r in range(self.tp)]
            if shared.any() and self.by_node[proj.weight].requires_grad:
                # Channels every rank uses whole inside a projection whose other channels
                # are query heads (the one k/v head of multi-query attention in a fused QKV
                # linear), or that a product reads whole beside split ones (that head read
                # by einsum, whatever else the projection holds: a parallel block's MLP):
                # each rank computes a block of them, all-gathered after it.
                queries = name in self.plan.gathered or (
                    (~shared).any() and np.isin(ids[~shared], self.queries).all()) or \
                    np.isin(self.asg.labels[ids[shared]], self.asg.labels[self.broadcast]).all()
                found = None if len(self.by_node[proj.weight].shape) != 2 or not queries else split_shared(
                    [np.flatnonzero(own == r) for r in range(self.tp)], np.flatnonzero(shared))
                if found is None:
                    why = (f"which tp={self.tp} cannot cut into one block per rank" if queries
                           else "beside channels that are not query heads")
                    raise LayoutFailure(ids, f"{self.describe(name)} mixes channels split over tp "
                                             f"ranks with {int(shared.sum())} channels every rank uses "
                                             f"whole, {why}: kept replicated")
                held, self.plan.shared_columns[name] = found
            ranges, local = tuple(ranges_of(h) for h in held), len(held[0])
            reason = f"column-parallel: output channels of {self.describe(name)}"
        self.propose(proj.weight, _Proposal(kind, proj.out_dim, ranges, local, reason, name))
        if proj.bias is not None:
            self.propose(proj.bias, _Proposal(kind, 0, ranges, local, reason, name))

    def row(self, name: str) -> None:
        proj = self.plan.row[name]
        x = self.plan.layouts[self.nodes[name].args[proj.input_arg].name]
        last = len(x.full) - 1
        ranges = tuple(ranges_of(x.held(last, r)) for r in range(self.tp))
        self.propose(proj.weight, _Proposal(ShardKind.ROW, proj.in_dim, ranges, x.shape[last],
                                            f"row-parallel: input channels of {self.describe(name)}",
                                            name))
        if proj.bias is not None:
            self.propose(proj.bias, _Proposal(ShardKind.REPLICATED, None, (), 0,
                                              "bias of a row-parallel projection, added once after "
                                              "the reduction", name))

    def embedding(self, name: str, weight: str) -> None:
        rows = self.by_node[weight].shape[0]
        ranges, block = vocab_ranges(rows, self.tp)
        self.propose(weight, _Proposal(ShardKind.VOCAB, 0, ranges, block,
                                       "vocab-parallel embedding (rows outside the rank's range "
                                       "are zeroed, then summed)", name))

    def others(self) -> None:
        claimed = set()
        for proj in (*self.plan.column.values(), *self.plan.row.values()):
            claimed |= {(proj.node, proj.weight), (proj.node, proj.bias)}
        claimed |= {(e, w) for e, w in self.plan.vocab_embedding.items()}
        claimed |= {(u.name, p) for p in self.plan.param_shards for u in self.nodes[p].users}
        for node in self.program.graph.nodes:
            if node.op != "placeholder" or node.name not in self.by_node:
                continue
            for user in node.users:
                # A weight read through transposes (Falcon's ``x @ w.T``) or a cast is the projection's.
                reader = user
                while reader.op == "call_function" and (reader.target in G.TRANSPOSES or reader.target is G.SELECT
                                                        or reader.target in G.CASTS) and len(reader.users) == 1:
                    reader = next(iter(reader.users))
                if (user.name, node.name) not in claimed and (reader.name, node.name) not in claimed:
                    self.propose(node.name, _Proposal(ShardKind.REPLICATED, None, (), 0,
                                                      self.replicated_reason(
                        reader if reader.name in self.prov.sources else user), user.name))

    def replicated_reason(self, user) -> str:
        if user.name in self.prov.sources and user.name not in self.prov.attention:
            first, count = self.prov.sources[user.name]
            labels = np.unique(self.asg.labels[first:first + count])
            for label in labels:
                if int(label) in self.asg.reasons:
                    return f"projection {self.describe(user.name)} stays replicated: " \
                           f"{self.asg.reasons[int(label)]}"
            for dec in self.asg.attention.values():
                use = self.prov.attention[dec.node]
                if not dec.split_kv and np.isin(labels, self.asg.labels[
                        np.concatenate([use.k.ravel(), use.v.ravel()])]).any():
                    return (f"GQA: {dec.kv_heads} key/value heads do not divide over tp={self.tp}; "
                            f"replicated, each rank keeps its query heads' k/v (scatter)")
            return f"projection {self.describe(user.name)}: its output reaches no sharded consumer"
        if user.target is G.EMBEDDING:
            return "embedding indexed by values computed in the graph (positions), not token ids"
        kind = "buffer" if self.program.param(self._name(user)).kind is not ParamKind.PARAMETER \
            else "parameter"
        return f"{kind} read by {user.target} in a replicated region"

    def _name(self, user) -> str:
        node = next(a for a in user.all_input_nodes if a.name in self.by_node)
        return self.by_node[node.name].name

    def build(self) -> dict[str, ShardSpec]:
        for name in self.plan.column:
            self.column(name)
        for name in self.plan.row:
            self.row(name)
        for name, weight in self.plan.vocab_embedding.items():
            self.embedding(name, weight)
        for name, ps in self.plan.param_shards.items():
            self.propose(name, _Proposal(ShardKind.COLUMN, ps.dim, tuple(ranges_of(p) for p in ps.positions),
                                         len(ps.positions[0]), "split with the channels it is applied to "
                                         f"({self.describe(ps.consumers[0])})", name))
        self.others()
        specs = self.unify()
        check_gradient_invariant(specs, str)
        return specs

    def unify(self) -> dict[str, ShardSpec]:
        groups = self.program.tied_groups
        specs = {}
        for p in self.program.params:
            canonical = p.canonical
            if canonical in specs:
                continue
            info = self.program.param(canonical)
            props = self.props.get(canonical, [])
            keys = {(q.kind, q.dim, q.ranges, q.local) for q in props}
            members = groups.get(canonical, (canonical,))
            if len(keys) > 1:
                self.conflict(canonical, props)
            if not props and info.kind is ParamKind.PARAMETER:
                spec = _unread(info, members, self.tp)
                if spec is not None:
                    specs[canonical] = spec
                    continue
            if not props or props[0].kind is ShardKind.REPLICATED:
                reason = props[0].reason if props else "not read by the graph"
                specs[canonical] = ShardSpec(canonical, ShardKind.REPLICATED, info.shape, info.shape,
                                             members=members, reason=reason)
                continue
            q = props[0]
            local = list(info.shape)
            local[q.dim] = q.local
            specs[canonical] = ShardSpec(canonical, q.kind, info.shape, tuple(local), q.dim, q.ranges,
                                         members, q.reason)
        return specs

    def conflict(self, canonical: str, props: list[_Proposal]) -> None:
        lookups = [q.origin for q in props if q.origin in self.plan.vocab_embedding]
        if lookups:
            raise _DropLookups(lookups)
        sharded = [q.origin for q in props if q.kind is not ShardKind.REPLICATED]
        ids = []
        for origin in sharded:
            if origin in self.plan.row:
                ids.append(self.prov.rows[origin])
            elif origin in self.plan.param_shards:
                for c in self.plan.param_shards[origin].consumers:
                    got = self.prov.ids.get(c)
                    ids += [np.asarray(i).ravel() for i in (got if isinstance(got, list) else [got])
                            if i is not None]
            else:
                first, count = self.prov.sources[origin]
                ids.append(np.arange(first, first + count))
        raise LayoutFailure(np.concatenate(ids), f"{canonical} is used with different placements "
                                                 f"({', '.join(sorted({q.kind.value for q in props}))})")


def _unread(info, members: tuple[str, ...], tp: int) -> ShardSpec | None:
    """A parameter the graph never reads (a decoder's cross-attention without an encoder)
    has no gradient and no reader: each rank keeps one block of it, along its first
    dim that tp divides, so that no rank holds it whole. None: no such dim."""
    dim = next((d for d, n in enumerate(info.shape) if n % tp == 0 and n >= tp), None)
    if dim is None:
        return None
    block = info.shape[dim] // tp
    local = list(info.shape)
    local[dim] = block
    return ShardSpec(info.name, ShardKind.COLUMN, info.shape, tuple(local), dim,
                     tuple(((r * block, (r + 1) * block),) for r in range(tp)), members,
                     "not read by the graph: split in equal blocks (no rank reads it)")


class _DropLookups(Exception):
    def __init__(self, lookups: list[str]) -> None:
        super().__init__(lookups)
        self.lookups = lookups


def check_gradient_invariant(specs: dict[str, ShardSpec], describe: Callable[[str], str]) -> None:
    """Every parameter's gradient is either sharded consistently with its value or the
    same on every rank (docs/tensor_parallel.md, "The gradient invariant").

    The pass only splits Megatron blocks: a column-parallel weight's rows feed only this
    rank's heads / FFN channels (f's backward all-reduce makes the input gradient whole),
    a row-parallel weight's columns read only this rank's channels, a vocabulary shard
    only this rank's rows; everything else is replicated and computed identically on
    every rank (f / g / gather conversions keep replicated values and their gradients
    identical). That argument holds when each index of a split dim belongs to exactly
    one rank; an index on several ranks gets a partial gradient on each, which nothing
    sums. So: the ranks' ranges must be disjoint, and must cover the dim."""
    for name, spec in specs.items():
        if spec.kind is ShardKind.REPLICATED:
            continue
        size = spec.full_shape[spec.dim]
        counts = np.bincount(np.concatenate([np.asarray(spec.indices(r), dtype=np.int64)
                                             for r in range(spec.tp)]), minlength=size)
        dup, missing = np.flatnonzero(counts > 1), np.flatnonzero(counts == 0)
        if dup.size or missing.size:
            raise ValueError(
                f"tensor parallelism cannot prove {describe(name)}'s gradient correct: its {spec.kind.value} "
                f"shards {'overlap at ' + str(dup[:8].tolist()) if dup.size else 'miss ' + str(missing[:8].tolist())} "
                f"(indices held by several ranks get partial gradients that nothing sums). Please report "
                f"this model; tp=1 trains it correctly")


def build_specs(program: Program, prov: Provenance, asg: Assignment, plan: TPPlan,
                describe: Callable[[str], str]) -> dict[str, ShardSpec]:
    """Specs for every canonical parameter; may drop vocab-parallel lookups from
    ``plan`` (tied to a replicated head) or raise LayoutFailure (retry)."""
    while True:
        try:
            return _Specs(program, prov, asg, plan, describe).build()
        except _DropLookups as drop:
            for name in drop.lookups:
                del plan.vocab_embedding[name]
                for sink, site in list(plan.partial.items()):
                    if site.source == name:
                        del plan.partial[sink]


def blocks(program: Program, prov: Provenance, asg: Assignment, plan: TPPlan) -> tuple[BlockInfo, ...]:
    """The Megatron blocks found, for the report."""
    tp = plan.tp
    names = {p.node: p.name for p in program.params}
    out = []
    n = len(asg.class_rank)

    def mask(ids: np.ndarray) -> np.ndarray:
        m = np.zeros(n, dtype=bool)
        m[asg.labels[ids]] = True
        return m

    col_ids = {}
    for name in plan.column:
        first, count = prov.sources[name]
        col_ids[name] = np.arange(first, first + count)
    for name, proj in plan.row.items():
        lab = mask(prov.rows[name])
        cols = tuple(names[plan.column[c].weight] for c in plan.column if lab[asg.labels[col_ids[c]]].any())
        width = len(prov.rows[name])
        if asg.rows[name] == "attention":
            dec = next((d for d in asg.attention.values()
                        if lab[asg.labels[prov.attention[d.node].out]].all()), None)
            detail = (f"heads {dec.heads} ({dec.heads // tp}/rank), kv heads {dec.kv_heads} "
                      f"{'split' if dec.split_kv else 'replicated'}" if dec else f"{width} channels")
            kind = BlockKind.ATTENTION
        else:
            detail, kind = f"ffn {width} ({width // tp}/rank)", BlockKind.MLP
        out.append(BlockInfo(kind, program.layers.get(name), cols, (names[proj.weight],),
                             f"{detail}; column: {', '.join(cols)}; row: {names[proj.weight]}"))
    for ce, vocab in plan.vocab_ce.items():
        lab = mask(prov.losses[ce])
        heads = tuple(names[plan.column[c].weight] for c in plan.column if lab[asg.labels[col_ids[c]]].any())
        out.append(BlockInfo(BlockKind.LM_HEAD, program.layers.get(ce), heads, (),
                             f"vocab {vocab} -> {math.ceil(vocab / tp) * tp} padded; "
                             f"{', '.join(heads)} + vocab-parallel cross-entropy"))
    for emb, weight in plan.vocab_embedding.items():
        # torch.export may route tied names through one placeholder: name the canonical one.
        info = program.param(program.param(names[weight]).canonical)
        rows = info.shape[0]
        out.append(BlockInfo(BlockKind.EMBEDDING, program.layers.get(emb), (info.name,), (),
                             f"vocab {rows} -> {math.ceil(rows / tp) * tp} padded; {info.name}"))
    return tuple(out)
