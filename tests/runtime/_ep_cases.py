"""Expert parallelism at dp=2 inside a gloo world (importable by the workers), and its
one-process reference."""
from __future__ import annotations

import torch

ROWS, STEPS, LR = 4, 2, 0.1


def model_and_batch(rows: int = ROWS):
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    from tests.passes.tensor_parallel._tp_models import T, V, StackedExperts

    torch.manual_seed(0)
    ids = torch.randint(0, V, (rows, T))
    torch.manual_seed(1)
    return StackedExperts("grouped"), (ids, ids.roll(-1, 1))


def workload():
    """The grouped MoE by name (``tests.runtime._ep_cases:workload``) for the equivalence
    worlds: 16 rows, a global batch for dp=4 × 4 microbatches."""
    return model_and_batch(16)


def reference() -> dict:
    """One process, full batch: losses, first-step gradients, and the router's top-2
    choices on the first step counted per expert (forward hook on the router)."""
    model, batch = model_and_batch()
    chosen = []
    model.router.register_forward_hook(lambda m, i, out: chosen.append(out.softmax(-1).topk(2, dim=-1).indices))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
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
        if step == 0:
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
    return dict(losses=losses, grads=grads, tokens=tokens, params=params,
                norm=torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item())


def ep_case(rank: int, world: int, directory: str) -> dict:
    """Two SGD steps (momentum: optimizer state to checkpoint) at dp=2, ep=2; after the first, a checkpoint and a safetensors
    export; after the second, the checkpoint loaded back and the second step run again."""
    from fxpipe.parallel import parallelize
    from fxpipe.checkpoint.dcp import load_checkpoint, save_checkpoint
    from fxpipe.checkpoint.export import export_consolidated
    from fxpipe.runtime.grad_norm import global_grad_norm

    model, batch = model_and_batch()
    pm = parallelize(model, ep=2, microbatches=2, example_inputs=batch, costs="model")
    opt = torch.optim.SGD(pm.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        losses.append(pm.train_step(batch))
        if step == 0:
            held = {n: tuple(t.shape) for n, t in pm.state.items() if n in pm.experts.params}
            grads = pm.gather_full({n: t.grad.clone() for n, t in pm.named_parameters()})
            norm = global_grad_norm(pm)
            tokens = pm.tokens_per_expert()
        opt.step()
        if step == 0:
            save_checkpoint(pm, opt, 1, f"{directory}/ckpt")
            export_consolidated(pm, f"{directory}/model.safetensors")
    load_checkpoint(pm, opt, f"{directory}/ckpt")
    again = pm.train_step(batch)
    pm.close()
    # The same checkpoint read by a layout without expert parallelism (every rank all experts).
    model, _ = model_and_batch()
    whole = parallelize(model, microbatches=2, example_inputs=batch, costs="model")
    load_checkpoint(whole, None, f"{directory}/ckpt")
    resharded = whole.full_state_dict()
    whole.close()
    return dict(losses=losses, grads=grads, norm=norm, tokens=tokens, held=held, again=again, resharded=resharded)
