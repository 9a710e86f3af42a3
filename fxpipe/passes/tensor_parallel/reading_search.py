"""The layout search: provenance, then assign/plan/placement until every layout is
expressible, for each way of reading the graph's optional rules; the one that leaves
each rank the smallest share of the parameters wins.

Some rules are choices, not facts. A private norm's statistic may be all-reduced
(its channels split) or unite its channels (``norms.private_norm``): the first
is right for a sub-norm before a row-parallel projection, the second for the
low-rank latent of multi-head latent attention, whose next projection must stay
column-parallel. A projection that would be both row- and column-parallel gives up
either its output channels (a plain MLP before a vocabulary head) or its input
channels (a low-rank pair whose second half is split by heads), planned both ways
when it happens. Every reading is planned and measured; each is correct.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.shard_spec import ShardSpec
from fxpipe.passes.tensor_parallel.assign import Assignment, assign
from fxpipe.passes.tensor_parallel.coverage import measure_coverage
from fxpipe.passes.tensor_parallel.gathered import gathered_projections
from fxpipe.passes.tensor_parallel.layout import LayoutFailure
from fxpipe.passes.tensor_parallel.plan import Conflict, build_plan
from fxpipe.passes.tensor_parallel.plan_record import GraphFacts, TPPlan
from fxpipe.passes.tensor_parallel.placement import build_specs
from fxpipe.passes.tensor_parallel.provenance import Provenance, analyze, shared_copies, split_statistics


@dataclass(frozen=True)
class Layouts:
    """The reading the search chose: its provenance, channel owners, plan and parameter shards."""
    prov: Provenance
    asg: Assignment
    plan: TPPlan
    specs: dict[str, ShardSpec]


def search(facts: GraphFacts) -> Layouts:
    program, graph, projections, tp = facts.program, facts.graph, facts.projections, facts.tp
    constants = {p.node: program.state[p.canonical] for p in program.params
                 if p.kind is ParamKind.CONSTANT and p.canonical in program.state}
    first = analyze(graph, projections, constants=constants)
    copies = shared_copies(first)
    readings = []
    for private in (False, True):
        stats = split_statistics(first, private)
        if (stats, copies) not in readings:
            readings.append((stats, copies))
    best, best_share = None, 2.0
    for i, (stats, cp) in enumerate(readings):
        # a second sweep, with those reductions no longer uniting their channels and
        # those expands' copies channels of their own
        prov = analyze(graph, projections, stats, cp, constants) if stats or cp else first
        for rows in (False, True):
            try:
                found, conflicted = _layouts(facts, prov, rows)
            except ValueError:
                if i == 0 and not rows:
                    raise  # heads or FFN sizes that tp does not divide: the user's to fix
                break  # an optional reading that splits what tp cannot: not taken
            share = measure_coverage(program, found.specs, tp).share
            if share < best_share - 1e-12:
                best, best_share = found, share
            if not conflicted:
                break  # no projection was both row- and column-parallel: nothing to choose
    assert best is not None
    return best


def _layouts(facts: GraphFacts, prov: Provenance, conflict_rows: bool = False) -> tuple[Layouts, bool]:
    """The layouts, and whether a projection wanted to be both row- and column-parallel
    (``conflict_rows`` says which side gives way)."""
    program, tp, describe = facts.program, facts.tp, facts.describe
    replicate: list = []
    conflicted = False
    for _ in range(prov.n_ids + 1):  # each failed round replicates at least one more class
        asg = assign(prov, tp, replicate, describe)
        gathered = gathered_projections(facts.graph, prov, asg, facts.projections, _weights_2d(program), tp,
                                        replicate)
        try:
            plan = build_plan(facts, prov, asg, gathered, conflict_rows)
            specs = build_specs(program, prov, asg, plan, describe)
            return Layouts(prov, asg, plan, specs), conflicted
        except LayoutFailure as failure:
            conflicted |= isinstance(failure, Conflict)
            replicate.append((failure.ids, failure.reason))
    raise AssertionError("tensor-parallel layout search did not converge")  # pragma: no cover


def _weights_2d(program: Program) -> set[str]:
    return {p.node for p in program.params
            if p.kind is ParamKind.PARAMETER and p.requires_grad and len(p.shape) == 2}
