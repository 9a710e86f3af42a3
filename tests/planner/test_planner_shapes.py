"""Parameter counts and FLOPs formulas of the paper's models."""
import pytest

from fxpipe.models.registry import GPT_CONFIGS
from fxpipe.passes.recompute import RecomputeMode
from fxpipe.planner import model_flops, shape_from_registry
from fxpipe.planner.sc21 import TABLE1

PAPER_SIZE = {"1.7B": 1.7e9, "3.6B": 3.6e9, "7.5B": 7.5e9, "18B": 18e9, "39B": 39e9, "76B": 76e9,
              "145B": 145e9, "310B": 310e9, "530B": 530e9, "1T": 1e12}


@pytest.mark.parametrize("row", TABLE1, ids=lambda r: r.label)
def test_table1_parameter_counts(row):
    shape = row.shape()
    l, h, V, s = shape.layers, shape.hidden, shape.vocab, shape.seq
    assert shape.num_params == l * (12 * h * h + 13 * h) + V * h + s * h + 2 * h
    assert shape.num_params == GPT_CONFIGS[row.model].num_params
    assert (V, s) == (51200, 2048)
    assert abs(shape.num_params / PAPER_SIZE[row.label] - 1) < 0.05


def test_seed_shapes():
    got = {r.label: (shape_from_registry(r.model).heads, shape_from_registry(r.model).hidden,
                     shape_from_registry(r.model).layers) for r in TABLE1}
    assert got["1T"] == (160, 25600, 128) and got["530B"] == (128, 20480, 105)
    assert got["1.7B"] == (24, 2304, 24) and got["145B"] == (96, 12288, 80)


def test_model_flops_formulas():
    shape = shape_from_registry("gpt3-175b")
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    full = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    none = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert model_flops(shape, B, RecomputeMode.FULL) == pytest.approx(full)
    assert model_flops(shape, B, RecomputeMode.NONE) == pytest.approx(none)
    # per layer and sequence: full = 4 × (24sh² + 4s²h) + 6shV, none = 3 × ... + 6shV
    fwd = 24 * s * h * h + 4 * s * s * h
    assert model_flops(shape, 1, RecomputeMode.FULL) == pytest.approx(l * 4 * fwd + 6 * s * h * V)
    assert model_flops(shape, 1, RecomputeMode.SELECTIVE) == pytest.approx(
        l * (3 * fwd + 4 * s * s * h) + 6 * s * h * V)


def test_unknown_model_lists_valid_names():
    with pytest.raises(ValueError, match="gpt-1t"):
        shape_from_registry("gpt-2t")
