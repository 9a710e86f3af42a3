"""The TP pass's op rules are tables keyed by ATen op: an op in two groups takes the
first group's rule, and the two tables (channel provenance, plan) name ATen ops only."""
import operator

import torch

from fxpipe.passes.tensor_parallel import plan, provenance
from fxpipe.passes.tensor_parallel.graph_ops import op_table

aten = torch.ops.aten


def test_an_op_in_two_groups_takes_the_first_rule():
    def first(): ...
    def second(): ...
    table = op_table((aten.max.dim, first), (frozenset({aten.max.dim, aten.amax.default}), second))
    assert table == {aten.max.dim: first, aten.amax.default: second}


def test_tables_are_keyed_by_aten_op():
    for table in (provenance.RULES, plan.RULES):
        assert all(isinstance(op, torch._ops.OpOverload) or op is operator.getitem for op in table)
    # max.dim returns (values, indices): both carry the reduced ids, unlike amax's one tensor.
    assert provenance.RULES[aten.max.dim] is not provenance.RULES[aten.amax.default]
    assert plan.RULES[aten.max.dim] is plan.RULES[aten.amax.default]
