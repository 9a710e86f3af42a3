"""Smoke test of benchmarks/compat.py's per-family logic (capture column only, in-process),
for Hugging Face families and zoo rows, so the compatibility-matrix script does not rot
between regenerations."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks"))

import compat  # noqa: E402
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
    assert analysis.status != "pass" or 0.5 <= analysis.share <= 1.0
    for count, reason in analysis.replicated:
        assert count > 0 and reason


def test_zoo_rows_build_and_capture():
    """The zoo's rows go through the same cells (build, capture, reference)."""
    assert "zoo:swa-gpt" in compat.select("zoo") and "gpt2" in compat.select("hf")
    assert compat.select("gpt2,zoo:moe,gpt2") == ["gpt2", "zoo:moe"]
    fam = compat_families.build("zoo:complex-rope")
    assert fam.batch[0].shape == (compat_families.BATCH, compat_families.SEQ)
    cap, analysis = compat_cells.capture_cell("zoo:complex-rope")
    assert cap.status == "pass", cap.detail
    assert compat_families.grad_rtol("zoo:autocast", 1e-4) == 1e-2
    assert compat_families.grad_rtol("zoo:llama3", 1e-4) == compat_families.grad_rtol("gpt2", 1e-4) == 1e-4


def test_an_error_from_a_worker_keeps_its_message_and_place():
    """Unpickling drops the traceback (and this exception type's message): both are read
    back from the traceback text the worker sent."""
    import pickle
    import traceback

    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    try:
        raise GuardOnDataDependentSymNode(None, "Could not guard on u0\nmore")
    except GuardOnDataDependentSymNode as exc:
        text, received = traceback.format_exc(), pickle.loads(pickle.dumps(exc))
    cell = compat_cells.classify(received, text)
    assert cell.status == "error"
    assert cell.detail.startswith("GuardOnDataDependentSymNode: Could not guard on u0 (at test_compat.py:")


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
           "tp2": {"status": "replicated", "replicated": [[2, "why"]], "detail": "", "share": 0.58},
           "pp2": {"status": "error", "detail": "KeyError: x"}, "tp2xpp2": {"status": "skipped", "detail": "tp2"}}
    zoo_row = {**row, "tp2": {"status": "mismatch", "detail": "step 1 loss 2 vs 1"}}
    rows = {"a": {**row, "transformers": "5.24.0"},
            "b": {"built": False, "reason": "no config", "transformers": "5.24.0"},
            "c": {**row, "transformers": "5.23.0"}, "zoo:m": zoo_row}
    text = render({"rows": rows, "meta": {}})
    assert "| `a` | ✅ pass | 🟨 replicated · share 0.58 (2 matrices): 2× why | 💥 error: KeyError: x |" in text
    # Sharded: a passing tp cell whose largest rank holds at most 0.60 of the parameters.
    assert "| tp2 | **2** | 0 | 0 | 2 | 0 | 0 | 0 | 0 |" in text.split("## Matrix")[0]
    assert "| `b` | no config |" in text
    # A page merged from two transformers releases says so; zoo rows are a table of their own.
    assert "- transformers 5.24.0 (2 families), 5.23.0 (1 families), " in text
    hf, zoo = text.split("## Beyond transformers")
    assert "zoo:m" not in hf and "| `zoo:m` | ✅ pass | ❌ **MISMATCH**: step 1 loss 2 vs 1 |" in zoo
    assert "| tp2 | 0 | 0 | 1 | 0 | 0 | 0 | 0 |" in zoo.split("## Families not attempted")[0]
    # The vocabulary-passes column shows only in a table where some row ran it.
    rows["zoo:m"]["pp2vocab"] = {"status": "refused", "detail": "vocab_passes=True: no LM head"}
    hf, zoo = render({"rows": rows, "meta": {}}).split("## Beyond transformers")
    assert "| family | capture | tp2 | pp2 | tp2×pp2 |\n" in hf
    assert "| model | capture | tp2 | pp2 | tp2×pp2 | pp2 vocab |" in zoo
    assert "| ⛔ refused: vocab_passes=True: no LM head |" in zoo
