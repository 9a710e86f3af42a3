import torch

import fxpipe
from fxpipe.models import build_workload
from fxpipe.passes.device import retarget_device_pass


def test_factory_ops_follow_the_target_device():
    w = build_workload("hf:llama", batch=2, seq=8)
    prog = fxpipe.capture(w.model, w.example_inputs, w.loss_fn)
    devices = lambda p: {n.kwargs["device"] for n in p.graph.nodes if "device" in n.kwargs}
    assert torch.device("cpu") in devices(prog)
    moved = retarget_device_pass(prog, torch.device("meta"))
    assert devices(moved) == {torch.device("meta")}
    assert devices(prog) != {torch.device("meta")}, "the input Program is untouched"
    same = retarget_device_pass(prog, torch.device("cpu"))
    assert same.run(same.state, *w.example_inputs).item() == prog.run(prog.state, *w.example_inputs).item()
