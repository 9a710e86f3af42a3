"""Constants and small helpers shared by test modules."""
import threading

# The five models the Foundation issue names: fxpipe's GPT and four HF families.
FIVE_MODELS = ["gpt-tiny", "hf:gpt2", "hf:llama", "hf:gpt_neox", "hf:opt"]


def within(seconds: float, fn, *args):
    """``fn(*args)`` in a thread; fails (instead of hanging the suite) if it blocks."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            box["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} blocked for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def node_value(v):
    """A node's ``meta["val"]`` as what a graph's equality rests on: each tensor's shape,
    strides, dtype, device and requires_grad (nested tuples kept), anything else as is."""
    import torch

    if isinstance(v, torch.Tensor):
        return tuple(v.shape), tuple(v.stride()), v.dtype, v.device, v.requires_grad
    if isinstance(v, (tuple, list)):
        return tuple(node_value(x) for x in v)
    return v
