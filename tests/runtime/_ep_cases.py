"""Expert parallelism at dp=2 inside a gloo world (importable by the workers), and its
one-process reference."""
from __future__ import annotations

import torch

ROWS, STEPS, LR = 4, 2, 1e-2


def model_and_batch():
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    from tests.tensor_parallel.test_tp_rules_experts import T, V, StackedExperts

    torch.manual_seed(0)
    ids = torch.randint(0, V, (ROWS, T))
    torch.manual_seed(1)
    return StackedExperts("grouped"), (ids, ids.roll(-1, 1))


def reference() -> dict:
    """One process, full batch: losses, first-step gradients, and the router's top-2
    choices on the first step counted per expert (forward hook on the router)."""
    model, batch = model_and_batch()
    chosen = []
    model.router.register_forward_hook(lambda m, i, out: chosen.append(out.softmax(-1).topk(2, dim=-1).indices))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            experts = model.gate_up.shape[0]
            tokens = torch.bincount(chosen[0].flatten(), minlength=experts).tolist()
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, grads=grads, tokens=tokens,
                norm=torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item())


def ep_case(rank: int, world: int) -> dict:
    from fxpipe.parallel import parallelize
    from fxpipe.runtime.grad_norm import global_grad_norm

    model, batch = model_and_batch()
    pm = parallelize(model, ep=2, microbatches=2, example_inputs=batch, costs="model")
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        losses.append(pm.train_step(batch))
        if step == 0:
            held = {n: tuple(t.shape) for n, t in pm.state.items() if n in pm.experts.params}
            grads = pm.gather_full({n: t.grad.clone() for n, t in pm.named_parameters()})
            norm = global_grad_norm(pm)
            tokens = pm.tokens_per_expert()
        opt.step()
    pm.close()
    return dict(losses=losses, grads=grads, norm=norm, tokens=tokens, held=held)
