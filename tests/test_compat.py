"""Smoke test of benchmarks/compat.py's per-family logic (capture column only, in-process),
so the compatibility-matrix script does not rot between regenerations."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import compat_cells  # noqa: E402
import compat_families  # noqa: E402
from compat_render import render  # noqa: E402

FAMILIES = ("gpt2", "falcon", "qwen2")


def test_families_are_discovered():
    names = compat_families.family_names()
    assert len(names) >= 40 and {"gpt2", "llama"} <= set(names)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_capture_cell(model_type):
    cfg = compat_families.tiny_config(model_type)
    assert cfg.vocab_size == compat_families.VOCAB
    cap, analysis = compat_cells.capture_cell(model_type)
    assert cap.status == "pass", cap.detail
    assert analysis is not None and analysis.status in ("pass", "refused", "error")
    for count, reason in analysis.replicated:
        assert count > 0 and reason


def test_compare_and_classify():
    ref = {"w": torch.ones(3), "kb": torch.full((2,), 1e-9)}
    # Rounding noise on an (exactly) zero gradient is below the floor: equal.
    assert compat_cells.compare([1.0, 0.9], {"w": torch.ones(3), "kb": torch.zeros(2)}, [1.0, 0.9], ref) == ""
    assert "step 2" in compat_cells.compare([1.0, 0.8], ref, [1.0, 0.9], ref)
    assert "gradient of w" in compat_cells.compare([1.0, 0.9], {**ref, "w": torch.ones(3) * 1.01},
                                                   [1.0, 0.9], ref)
    from fxpipe.passes.tensor_parallel import TPConfig
    with pytest.raises(ValueError) as info:  # fxpipe's own explicit error
        TPConfig(tp=0)
    assert compat_cells.classify(info.value).status == "refused"
    assert compat_cells.classify(_raise(KeyError("x"))).status == "error"


def _raise(exc):
    try:
        raise exc
    except Exception as caught:
        return caught


def test_render_lists_every_cell():
    row = {"built": True, "capture": {"status": "pass"},
           "tp2": {"status": "replicated", "replicated": [[2, "why"]], "detail": ""},
           "pp2": {"status": "error", "detail": "KeyError: x"}, "tp2xpp2": {"status": "skipped", "detail": "tp2"}}
    text = render({"rows": {"a": row, "b": {"built": False, "reason": "no config"}}, "meta": {}})
    assert "| `a` | ✅ pass | ✅ replicated (2 matrices): 2× why | 💥 error: KeyError: x |" in text
    assert "| `b` | no config |" in text
