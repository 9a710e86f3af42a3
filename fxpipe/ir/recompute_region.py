"""``CheckpointedRegion``: the module a recomputed region runs as, inside a stage graph.

The recompute pass (``passes/recompute.py``) outlines regions into it; the runtime
runs it (eagerly, or inlined by ``runtime/compiled.py`` with partitioner tags). It
lives outside both so that the runtime imports no pass.

Why not ``torch.utils.checkpoint``: its non-reentrant form runs a Python pack hook on
every tensor the region's ops save and an unpack hook (with a determinism check) on
every one backward reads, so its cost grows with the region's op count, not its
FLOPs. A region is instead one autograd node (``_Rerun``): the forward runs the body
without recording a graph and keeps the inputs; its backward reruns the body with the
graph on and differentiates it — a few Python calls per region whatever its size.
``benchmarks/bench_recompute.py`` (one thread, 8 × 32 tokens, four models): a step
with every layer recomputed took 1.86–2.35× the step without through
``torch.utils.checkpoint`` and 1.51–1.71× this way (0.73–0.84 of checkpoint's time).

Which inputs backward differentiates is what the engine will use: under the
zero-bubble split (``base/backward_split.py``) the I pass asks for the
activations' gradients only and W for the weights' only, so each pass reruns the
body and computes its half (the price's two reruns under a split backward,
``ir/parallel_config.py``); a plain backward computes both at once.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.base.backward_split import BackwardSplit
from fxpipe.tp.context import TPContext, current_tp_or_none, tp_group_context


def _random(body: fx.GraphModule) -> bool:
    """Whether the body draws random numbers (dropout, rand): only then must the rerun
    replay the generators' state. Read off the ops' own tags, not their names."""
    for node in body.graph.nodes:
        if node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            return True
        if node.op == "call_module" and _random(body.get_submodule(node.target)):
            return True
    return False


def _reached(node: Any) -> bool:
    """Whether the running engine call will deliver a gradient to ``node``."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        # Torch declines to answer for a leaf that autograd.grad was asked for: it is reached.
        return True


class CheckpointedRegion(nn.Module):
    """Runs ``body`` keeping only its inputs; backward reruns it (module docstring).

    Where the body draws random numbers, the rerun starts from the generators' state of
    the first run (torch's global ones, and the tensor-parallel dropout streams under
    TP), so dropout replays the same mask."""

    def __init__(self, body: fx.GraphModule) -> None:
        super().__init__()
        self.body = body
        self.random = _random(body)

    def forward(self, *args: object) -> tuple:
        if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self.body(*args)  # nothing to differentiate: nothing to keep
        return _Rerun.apply(_Replay(self.body, current_tp_or_none(), self.random, args), *args)


class _Replay:
    """What the rerun needs besides the inputs: the body, the TP context backward may not
    see, and (for a random body) the generators' state before the first run."""

    def __init__(self, body: fx.GraphModule, tp: TPContext | None, random: bool, args: tuple) -> None:
        self.body, self.tp = body, tp
        self.cpu = torch.get_rng_state() if random else None
        self.devices = sorted({a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"},
                              key=str) if random else []
        self.device_states = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.tp_state = tp.rng.get_state() if (random and tp is not None) else None

    def again(self, *args: object) -> Any:
        """The body once more, from the first run's random state; the generators are put
        back afterwards so later draws are unaffected."""
        if self.cpu is None:
            return self._run(*args)
        cpu, devices = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices]
        tp_after = self.tp.rng.get_state() if self.tp_state is not None else None
        torch.set_rng_state(self.cpu)
        for d, s in zip(self.devices, self.device_states):
            torch.cuda.set_rng_state(s, d)
        if tp_after is not None:
            self.tp.rng.restore(self.tp_state)
        try:
            return self._run(*args)
        finally:
            torch.set_rng_state(cpu)
            for d, s in zip(self.devices, devices):
                torch.cuda.set_rng_state(s, d)
            if tp_after is not None:
                self.tp.rng.restore(tp_after)

    def _run(self, *args: object) -> Any:
        if self.tp is None:
            return self.body(*args)
        with tp_group_context(self.tp.group, self.tp.rng):
            return self.body(*args)


class _Rerun(torch.autograd.Function):
    """One region as one autograd node (module docstring)."""

    @staticmethod
    def forward(ctx: Any, replay: _Replay, *args: object) -> tuple:
        ctx.replay = replay
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [a for a in args if not isinstance(a, torch.Tensor)]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        out = replay.body(*args)  # autograd records nothing inside a Function's forward
        single = not isinstance(out, (tuple, list))
        outs = (out,) if single else tuple(out)
        # An input passed through unchanged must be a new tensor to carry this node's history.
        held = {id(t) for t in tensors}
        outs = tuple(o.view_as(o) if isinstance(o, torch.Tensor) and id(o) in held else o for o in outs)
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor)
                                      and not (o.is_floating_point() or o.is_complex())])
        ctx.single = single
        return outs[0] if single else outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        saved = iter(ctx.saved_tensors)
        others = iter(ctx.others)
        args = [next(saved) if t else next(others) for t in ctx.is_tensor]
        differentiable = [ctx.needs_input_grad[i + 1] for i in range(len(args))]
        # Which inputs this engine call reaches: all in a plain backward (or a call outside
        # the engine); the activations' only in zero-bubble's I, the weights' only in W.
        in_engine = torch._C._current_graph_task_id() != -1
        edges = iter(ctx.next_functions)  # one per tensor input, in order
        wanted = []
        for a, need in zip(args, differentiable):
            if isinstance(a, torch.Tensor):
                node = next(edges)[0]
                if need and in_engine:
                    need = node is not None and _reached(node)
            wanted.append(need)
        if not any(wanted):
            return (None,) * (len(args) + 1)
        first = getattr(ctx, "first", None)
        if wanted == differentiable or (first is None and not in_engine):
            return (None, *_differentiate(ctx, args, wanted, grads))
        if first is not None and not any(w and f for w, f in zip(wanted, first[0])):
            ctx.first = None
            return (None, *_second_half(ctx, args, differentiable, first, grads))
        got, ctx.first = _first_half(ctx, args, wanted, differentiable, grads)
        return (None, *got)


def _rerun(ctx: Any, args: list, grad_of: list[bool], grads: tuple) -> tuple[list, list]:
    """The body run again with the graph on: (its inputs as fresh leaves, requiring grad
    where ``grad_of``; (output, incoming gradient) of each differentiable output)."""
    inputs = [a.detach().requires_grad_(g) if isinstance(a, torch.Tensor) else a for a, g in zip(args, grad_of)]
    with torch.enable_grad():
        out = ctx.replay.again(*inputs)
    outs = (out,) if ctx.single else tuple(out)
    pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    return inputs, pairs


def _differentiate(ctx: Any, args: list, wanted: list[bool], grads: tuple) -> list:
    """Rerun and differentiate the wanted inputs in one backward."""
    inputs, pairs = _rerun(ctx, args, wanted, grads)
    targets = [x for x, w in zip(inputs, wanted) if w]
    got = iter(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True)
               if pairs else [None] * len(targets))
    return [next(got) if w else None for w in wanted]


def _first_half(ctx: Any, args: list, wanted: list[bool], differentiable: list[bool], grads: tuple):
    """A split backward's first pass (zero-bubble's I): the wanted inputs' gradients, and
    what the rest still owes kept as the split's captured gradients, not as the graph
    (which is the memory recomputation exists to free): the second pass reruns the body
    and finishes from them, computing nothing of this pass again."""
    inputs, pairs = _rerun(ctx, args, differentiable, grads)
    rest = [d and not w for d, w in zip(differentiable, wanted)]
    split = _split(inputs, pairs, wanted, rest)
    got = iter(split.backward_input())
    return [next(got) if w else None for w in wanted], (tuple(wanted), split.owed())


def _second_half(ctx: Any, args: list, differentiable: list[bool], first: tuple, grads: tuple) -> list:
    """The pass after ``_first_half`` (zero-bubble's W): the other inputs' gradients."""
    asked, owed = first
    inputs, pairs = _rerun(ctx, args, differentiable, grads)
    rest = [d and not a for d, a in zip(differentiable, asked)]
    split = _split(inputs, pairs, list(asked), rest)
    split.owe(owed)
    split.backward_weight()
    return [x.grad if r else None for x, r in zip(inputs, rest)]


def _split(inputs: list, pairs: list, first: list[bool], rest: list[bool]) -> BackwardSplit:
    return BackwardSplit([o for o, _ in pairs], [g for _, g in pairs],
                         [x for x, f in zip(inputs, first) if f], [x for x, r in zip(inputs, rest) if r])
