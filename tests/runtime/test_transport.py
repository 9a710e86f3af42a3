import pytest
import torch

from fxpipe.ir.stage_plan import StageValue
from fxpipe.ir.program import TensorSpec
from fxpipe.ir.parallel_config import resolve_dp
from fxpipe.runtime.mesh import Mesh
from fxpipe.runtime.transport import TransferError, check_spec


def test_sent_tensor_must_match_the_plan():
    v = StageValue("add_3", 0, (1,), TensorSpec((2, 16, 64), torch.float32), True)
    check_spec(v, torch.zeros(2, 16, 64), "activation")
    with pytest.raises(TransferError, match=r"'add_3' .* shape \(2, 8, 64\).*expects \(2, 16, 64\)"):
        check_spec(v, torch.zeros(2, 8, 64), "activation")
    with pytest.raises(TransferError, match="float64"):
        check_spec(v, torch.zeros(2, 16, 64, dtype=torch.float64), "activation")


def test_mesh_layout_is_megatrons():
    """tp innermost, then dp, then pp (Megatron-LM initialize_model_parallel)."""
    m = Mesh(tp=2, dp=2, pp=2)
    assert m.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(m.rank(**dict(zip(("pp", "dp", "tp"), m.coords(r)))) == r for r in range(8))


def test_dp_mismatch_is_a_clear_error():
    assert resolve_dp(8, 2, 2, None) == 2
    with pytest.raises(ValueError, match="use dp=2"):
        resolve_dp(8, 2, 2, 3)
    with pytest.raises(ValueError, match="not divisible by tp·pp"):
        resolve_dp(6, 2, 2, None)


def _posts_counted_and_made(rank: int, world: int) -> tuple[int, int, dict]:
    """(posts the runtime counted, sends and receives it actually made, seconds counted)
    over two steps of calibration's tiny pipeline, every ``isend``/``irecv`` counted apart."""
    import torch.distributed as dist

    from fxpipe.planner.transfer_speeds import pipeline_posts

    made = [0]
    real = {name: getattr(dist, name) for name in ("isend", "irecv")}

    def counting(name):
        def post(*args, **kwargs):
            made[0] += 1
            return real[name](*args, **kwargs)
        return post

    for name in real:
        setattr(dist, name, counting(name))
    try:
        costs = pipeline_posts(steps=2, warmup=0)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return costs["posts"], made[0], costs


@pytest.mark.slow
def test_every_send_and_receive_the_runtime_posts_is_counted_with_its_time():
    """``Transport.posted_s`` / ``posts`` (what `fxpipe calibrate` prices each transfer end
    by) see every post: the activations' and gradients' and the tied table's lookups."""
    from tests.runtime._dist import run_world

    from fxpipe.planner.transfer_speeds import transfer_end_s

    results = run_world(2, _posts_counted_and_made)
    for counted, made, costs in results:
        # 8 microbatches × 2 steps: at least an activation each way, and the lookups.
        assert counted == made and made >= 2 * 8 * 2, (counted, made)
        assert costs["posted_s"] > 0 and 0 < costs["posted_cpu_s"] <= costs["posted_s"] * 1.05 + 1e-3
        if costs["transport_s"] is not None:  # Linux: gloo's transport threads ran for the messages
            assert costs["transport_s"] > 0
    # One transfer end's own time: posting CPU plus the transport threads', per post.
    every = [c for _, _, c in results]
    posts = sum(c["posts"] for c in every)
    if all(c["transport_s"] is not None for c in every):
        want = sum(c["posted_cpu_s"] + c["transport_s"] for c in every) / posts
    else:
        want = sum(c["posted_s"] for c in every) / posts
    assert transfer_end_s(every) == pytest.approx(want)
