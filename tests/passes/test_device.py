import torch

import fxpipe
from fxpipe.models import build_workload
from fxpipe.passes.device import retarget_device


def test_factory_ops_follow_the_target_device():
    w = build_workload("hf:llama", batch=2, seq=8)
    prog = fxpipe.capture(w.model, w.example_inputs, w.loss_fn)
    devices = lambda p: {n.kwargs["device"] for n in p.graph.nodes if "device" in n.kwargs}
    assert torch.device("cpu") in devices(prog)
    moved = retarget_device(prog, torch.device("meta"))
    assert devices(moved) == {torch.device("meta")}
    assert devices(prog) != {torch.device("meta")}, "the input Program is untouched"
    same = retarget_device(prog, torch.device("cpu"))
    assert same.run(same.state, *w.example_inputs).item() == prog.run(prog.state, *w.example_inputs).item()


class _Router(torch.nn.Module):
    """Counts tokens per expert the way transformers' grouped MoE does: integer ids on a
    GPU (or while traced on meta), float ids on a CPU, whose histc takes no integers."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(16, 8)

    def forward(self, x):
        logits = self.gate(x)
        ids = logits.argmax(-1)
        counts = torch.histc(ids.float() if ids.device.type in ("cpu", "mps") else ids.int(), bins=8, min=0, max=7)
        return (logits.sum(-1) * counts[ids].to(logits.dtype)).mean()


def test_a_histc_traced_on_meta_runs_on_the_cpu_as_its_cpu_branch():
    torch.manual_seed(0)
    eager = _Router()
    with torch.device("meta"):
        meta = _Router()
    x = torch.randn(64, 16)
    prog = fxpipe.capture(meta, (x.to("meta"),))
    histc = [n for n in prog.graph.nodes if n.target is torch.ops.aten.histc.default]
    assert histc and not histc[0].args[0].meta["val"].dtype.is_floating_point  # the GPU branch was traced
    moved = retarget_device(prog, torch.device("cpu"))
    state = dict(eager.named_parameters())
    assert moved.run(state, x).item() == eager(x).item()
    (h,) = [n for n in moved.graph.nodes if n.target is torch.ops.aten.histc.default]
    assert {h.args[0].name, next(iter(h.users)).name} <= set(moved.costs)  # the casts priced for the partition
    # A device whose histc takes integers keeps the graph as traced.
    assert retarget_device(prog, torch.device("meta")).graph_module.code.count("_to_copy") == \
        prog.graph_module.code.count("_to_copy")

