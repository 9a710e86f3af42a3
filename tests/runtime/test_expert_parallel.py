"""Expert parallelism (``passes/expert_parallel.py``, ``fxpipe/ep``, ``runtime/experts.py``):
a dropless grouped MoE at dp=2 with ep=2 equals one process on the full batch — losses
over two SGD steps, every gradient (experts, router, dense), the global gradient norm —
each rank holds half the experts, and the tokens per expert it reports are the router's
choices counted directly. One gloo world of 2; the refusals are checked in process."""
import pytest
import torch

pytest.importorskip("transformers.integrations.moe")

from fxpipe import ParallelConfig  # noqa: E402
from tests.runtime import _ep_cases  # noqa: E402
from tests.runtime._dist import run_world  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ep")
    return directory, run_world(2, _ep_cases.ep_case, str(directory))


def test_ep2_equals_one_process(world):
    from safetensors.torch import load_file

    directory, world = world
    ref = _ep_cases.reference()
    for rank, out in enumerate(world):
        assert out["held"] == {"gate_up": (2, 128, 32), "down_w": (2, 32, 64)}, rank  # 2 of 4 experts
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5), rank
        assert set(out["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            assert g.abs().sum() > 0, name
            torch.testing.assert_close(out["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
        assert out["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        assert out["tokens"] == {0: ref["tokens"]}, rank
        assert sum(ref["tokens"]) == _ep_cases.ROWS * 8 * 2  # every token, top-2
        # The checkpoint after step 1 holds every rank's experts: loaded back, step 2 again.
        assert out["again"] == pytest.approx(out["losses"][1], rel=1e-6), rank
        for name, p in ref["params"].items():  # and read back at ep=1: every expert, in place
            torch.testing.assert_close(out["resharded"][name], p, rtol=1e-5, atol=1e-6, msg=name)
    exported = load_file(directory / "model.safetensors")  # the whole model after step 1
    assert exported.keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        torch.testing.assert_close(exported[name], p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout,message", [
    (dict(ep=3, dp=4), "ep=3 does not divide dp=4: the experts are owned by data-parallel ranks, "
                       "choose ep among [1, 2, 4]"),
    (dict(ep=2, dp=2, tp=2), "ep=2 with tp=2 is not built yet"),
    (dict(ep=2, dp=2, zero=1), "ep=2 with zero=1 is not built yet"),
    (dict(ep=2, dp=2, inductor=True), "ep=2 with inductor=True is not built yet"),
    (dict(ep=2, dp=2, recompute="full"), "ep=2 with recompute=full is not built yet: expert parallelism runs "
                                         "with recompute=none; use ep=1"),
    (dict(ep=0), "ep must be a positive integer"),
])
def test_config_refuses(layout, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ParallelConfig(**layout)
