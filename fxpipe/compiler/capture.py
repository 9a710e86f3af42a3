"""Capture a model and its loss as one ATen graph with torch.export (non-strict).

Why torch.export and not ``torch.fx.symbolic_trace``: symbolic tracing fails on
every current Hugging Face causal LM (Python control flow on tensor properties),
while non-strict export runs the real Python with fake tensors and records the
ATen ops of the training IR, which autograd can still differentiate.

The model is never changed. It is wrapped in a module whose forward computes the
loss, so the graph ends in one scalar; parameters and buffers are lifted to graph
inputs and keep their original fully-qualified names in ``Program.params``.
"""
from __future__ import annotations

import inspect
import os
import re
import traceback
from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.export.graph_signature import InputKind, OutputKind

from fxpipe.ir.program import ParamInfo, ParamKind, Program, TensorSpec
from fxpipe.ir.sizes import observe_sizes, unbacked_symbols
from fxpipe.passes.functionalize import FunctionalizeError, functionalize

_WRAPPED = "model"  # attribute name of the user's model inside the loss wrapper


class CaptureError(RuntimeError):
    """The model could not be captured; the message says where and what to try."""


class _LossModule(nn.Module):
    """``forward(*batch)`` -> scalar loss, from the user's model and optional loss_fn.

    With ``loss_fn`` the last batch item is the target: ``loss_fn(model(*batch[:-1]),
    batch[-1])``. Without it the model's own output must be (or contain) the loss.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                 model_kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.model_kwargs = model_kwargs

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not None:
            out = self.model(*batch[:-1], **self.model_kwargs)
            return self.loss_fn(out, batch[-1])
        return _loss_of(self.model(*batch, **self.model_kwargs))


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(
        f"the model returned {type(out).__name__}"
        f"{' of shape ' + str(tuple(out.shape)) if isinstance(out, torch.Tensor) else ''}, "
        f"not a scalar loss; pass loss_fn=... (e.g. fxpipe.models.losses.causal_lm_loss) with the "
        f"target as the last item of example_inputs")


def _model_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments that make a causal LM's forward pure training computation.

    A KV cache is inference state: if the forward takes ``use_cache``, turn it off."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def _check_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(f"example_inputs must be a tuple of tensors (one batch), "
                        f"got {type(example_inputs).__name__}")
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"example_inputs[{i}] is a {type(x).__name__}, not a tensor; "
                            f"pass the batch as a tuple of tensors")
    if not example_inputs:
        raise TypeError("example_inputs is empty; pass one batch as a tuple of tensors")
    return tuple(example_inputs)


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame outside torch and fxpipe: the model's source line."""
    skip = (os.path.dirname(torch.__file__), __file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(skip) and not f.filename.startswith("<")
              and "importlib" not in f.filename]
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        inner = _user_frame(cause)
        if inner:
            return inner
    if not frames:
        # Some torch errors name the user line only in their message.
        m = re.search(r'File "([^"]+)", line (\d+)', str(exc))
        return f"{m.group(1)}:{m.group(2)}" if m else None
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"


def _capture_error(model: nn.Module, inputs: Sequence[torch.Tensor], exc: BaseException) -> CaptureError:
    where = _user_frame(exc)
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    data_dependent = any(k in str(exc) for k in (
        "data-dependent", "data dependent", "GuardOnDataDependent", "Could not guard",
        "Could not extract specialized integer"))
    shapes = ", ".join(f"{tuple(x.shape)}:{x.dtype}" for x in inputs)
    if data_dependent:
        hint = ("the model branches on a tensor's value (Python control flow such as "
                "`if x.sum() > 0:`), which a graph cannot capture; rewrite it with "
                "torch.where / torch.cond, or move the decision out of forward")
    else:
        hint = (f"check that example_inputs ({shapes}) is one batch exactly as the model's "
                f"forward takes it (the loss target last when loss_fn is given)")
    return CaptureError(
        f"torch.export could not capture {type(model).__name__}: {type(exc).__name__}: {first}\n"
        f"  at: {where or 'no source line reported'}\n"
        f"  try: {hint}")


def capture(model: nn.Module, example_inputs: Any,
            loss_fn: Callable[..., torch.Tensor] | None = None) -> Program:
    """Capture ``model`` (+ ``loss_fn``) in training mode as a :class:`Program`.

    ``example_inputs`` is one batch, a tuple of tensors; with ``loss_fn`` its last
    item is the target. Works on meta tensors (no weights allocated)::

        prog = fxpipe.capture(GPT(cfg), (idx, targets))
        loss = prog.run(prog.state, idx, targets)
    """
    inputs = _check_inputs(example_inputs)
    wrapper = _LossModule(model, loss_fn, _model_kwargs(model))
    was_training = model.training
    model.train()
    try:
        exported = torch.export.export(wrapper, inputs, strict=False)
    except (TypeError, CaptureError):
        raise
    except Exception as exc:  # torch raises many types; all become one clear error
        raise _capture_error(model, inputs, exc) from exc
    finally:
        model.train(was_training)
    return _to_program(model, exported, inputs)


def _strip(name: str) -> str:
    return name[len(_WRAPPED) + 1:] if name.startswith(_WRAPPED + ".") else name


def _to_program(model: nn.Module, ep: torch.export.ExportedProgram,
                inputs: tuple[torch.Tensor, ...]) -> Program:
    sig = ep.graph_signature
    # The training IR keeps the model's in-place ops; every pass after capture assumes
    # none (passes/functionalize.py). Buffers may be written: their new values become
    # outputs in front of the loss, written back by whoever runs the graph.
    buffers = {s.arg.name for s in sig.input_specs if s.kind is InputKind.BUFFER}
    names = {s.arg.name: (f"batch input {s.arg.name}" if s.target is None else _strip(s.target))
             for s in sig.input_specs}
    try:
        done = functionalize(ep.graph_module, writable=lambda n: n.name in buffers, names=names)
    except FunctionalizeError as exc:
        raise CaptureError(f"{type(model).__name__}: {exc}") from exc
    gm = done.graph_module
    # Tied tensors: several names, one storage. The canonical name is the first
    # registered one, the same choice nn.Module.named_parameters() makes.
    by_id: dict[int, list[str]] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    for name, t in named.items():
        by_id.setdefault(id(t), []).append(name)
    canonical = {n: names[0] for names in by_id.values() if len(names) > 1 for n in names}

    params: list[ParamInfo] = []
    user_inputs: list[str] = []
    state: dict[str, torch.Tensor] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(sig.input_specs)
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind is InputKind.USER_INPUT:
            user_inputs.append(node.name)
            continue
        persistent = True
        if spec.kind is InputKind.PARAMETER:
            kind, tensor = ParamKind.PARAMETER, ep.state_dict[spec.target]
        elif spec.kind is InputKind.BUFFER:
            kind, persistent = ParamKind.BUFFER, bool(spec.persistent)
            tensor = ep.state_dict[spec.target] if spec.persistent else ep.constants[spec.target]
        else:  # lifted tensor constants (e.g. a literal torch.tensor in forward)
            kind, tensor = ParamKind.CONSTANT, ep.constants[spec.target]
        name = _strip(spec.target)
        group = canonical.get(name)
        params.append(ParamInfo(name=name, node=node.name, shape=tuple(tensor.shape),
                                dtype=tensor.dtype, kind=kind,
                                requires_grad=kind is ParamKind.PARAMETER and tensor.requires_grad,
                                persistent=persistent, tied_group=group))
        state.setdefault(group or name, tensor)
        node.meta["fxpipe_fqn"] = name
    assert len(user_inputs) == len(inputs), "every batch tensor becomes one graph input"

    buffer_of = {p.node: p.name for p in params}
    mutated = tuple(buffer_of[name] for name, _ in done.buffer_updates)
    mutated += tuple(_strip(s.target) for s in sig.output_specs if s.kind is OutputKind.BUFFER_MUTATION)
    loss_index = len(done.buffer_updates) + next(
        i for i, s in enumerate(sig.output_specs) if s.kind is OutputKind.USER_OUTPUT)
    module_paths, layers, container = _module_structure(gm)
    program = Program(graph_module=gm, params=tuple(params), inputs=tuple(user_inputs),
                      input_specs=tuple(TensorSpec.of(x) for x in inputs), loss_output=loss_index,
                      mutated_buffers=mutated, state=state, source=type(model).__name__,
                      module_paths=module_paths, layers=layers, layer_container=container)
    return program.replace(size_hints=_size_hints(program, inputs))


def _size_hints(program: Program, inputs: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """Data-dependent sizes as the example batch makes them (fxpipe/ir/sizes.py): one run of
    the graph without autograd, only when the graph has such sizes and real tensors."""
    if not unbacked_symbols(program.graph_module):
        return {}
    args = [program.state[p.canonical] for p in program.params] + list(inputs)
    if any(a.device.type == "meta" for a in args):
        return {}  # priced at their upper bounds
    return observe_sizes(program.graph_module, args)


_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def _module_structure(gm: torch.fx.GraphModule) -> tuple[dict[str, str], dict[str, int], str]:
    """Module path of every node and, for nodes inside a repeated-layer container
    (a ModuleList: a path component that is an integer), the layer index.

    The container is found from structure alone: the indexed container holding
    the most nodes. No module or class name is looked at."""
    paths: dict[str, str] = {}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1][0]
            paths[node.name] = _strip(path) if path != _WRAPPED else ""
        else:
            paths[node.name] = ""
    counts: Counter[str] = Counter()
    for path in paths.values():
        m = _LAYER.match(path)
        if m:
            counts[m.group(1)] += 1
    if not counts:
        return paths, {}, ""
    container = counts.most_common(1)[0][0]
    layers = {}
    for name, path in paths.items():
        m = _LAYER.match(path)
        if m and m.group(1) == container:
            layers[name] = int(m.group(2))
    return paths, layers, container
