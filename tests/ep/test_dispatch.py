"""``ep_dispatch`` / ``ep_combine`` over emulated expert groups of 2 and 4 ranks with
uneven (and empty) per-expert counts, against closed forms: every rank receives exactly
its experts' rows from every rank, expert-major; a per-expert function applied between
them comes back to each row, and so does its gradient."""
import pytest
import torch

from fxpipe.ep import all_to_all, ep_combine, ep_dispatch, expert_group_context
from fxpipe.tp import run_emulated

E, H = 8, 3


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens sorted by expert: values encode (rank, row), counts uneven,
    expert 3 chosen by nobody."""
    g = torch.Generator().manual_seed(rank)
    counts = torch.randint(0, 4, (E,), generator=g)
    counts[3] = 0
    expert = torch.repeat_interleave(torch.arange(E), counts)
    x = torch.stack([torch.full((H,), 100.0 * rank + i) for i in range(len(expert))]) if len(expert) \
        else torch.zeros(0, H)
    return x.requires_grad_(True), counts.cumsum(0).to(torch.int32), expert


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_combine_closed_form(ep):
    per_rank = E // ep

    def step(group):
        x, offs, expert = _rows(group.rank)
        with expert_group_context(group) as ctx:
            local, offs_local, route = ep_dispatch(x, offs, 0)
            # Each local expert j scales its rows by its global id + 1.
            ids = torch.repeat_interleave(torch.arange(per_rank), torch.diff(offs_local.long(), prepend=torch.zeros(1, dtype=torch.long)))
            y = ep_combine(local * (group.rank * per_rank + ids + 1).unsqueeze(1), route)
        y.sum().backward()
        return x.detach(), expert, local.detach(), offs_local, y.detach(), x.grad, ctx.tokens[0]

    out = run_emulated(ep, step)
    for rank, (x, expert, local, offs_local, y, grad, tokens) in enumerate(out):
        scale = (expert + 1).unsqueeze(1).float()
        torch.testing.assert_close(y, x * scale)  # every row home, through its own expert
        torch.testing.assert_close(grad, scale.expand_as(x))
        assert tokens.tolist() == torch.bincount(expert, minlength=E).tolist()
        # What this rank's experts received: for each of its experts, each source's rows in order.
        want = [src_x[src_e == e] for e in range(rank * per_rank, (rank + 1) * per_rank)
                for src_x, src_e, *_ in out]
        torch.testing.assert_close(local, torch.cat(want))
        counts = [sum(int((src_e == e).sum()) for _, src_e, *_ in out) for e in range(rank * per_rank, (rank + 1) * per_rank)]
        assert offs_local.tolist() == torch.tensor(counts).cumsum(0).tolist()


def test_all_to_all_backward_swaps_the_splits():
    def step(group):
        x = torch.arange(6.0).view(3, 2).add(10 * group.rank).requires_grad_(True)
        send, recv = ((1, 2), (1, 2)) if group.rank == 0 else ((2, 1), (2, 1))
        out = all_to_all(x, send, recv, group)
        (out * torch.arange(1.0, out.shape[0] + 1).unsqueeze(1)).sum().backward()
        return out.detach(), x.grad

    (out0, g0), (out1, g1) = run_emulated(2, step)
    assert out0[:, 0].tolist() == [0.0, 10.0, 12.0] and out1[:, 0].tolist() == [2.0, 4.0, 14.0]
    # Row 0 of rank 0 stayed (weight 1); rows 1, 2 went to rank 1's positions 1, 2 (weights 1, 2).
    assert g0[:, 0].tolist() == [1.0, 1.0, 2.0] and g1[:, 0].tolist() == [2.0, 3.0, 3.0]
