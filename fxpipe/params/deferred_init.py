"""Deferred initialisation: a model built on the meta device, materialised shard by shard.

``record_init(model)`` runs the model's own init scheme — every submodule's
``reset_parameters()``, then the model's ``init_weights()`` (Hugging Face's, fxpipe's
GPT) or else its per-module ``_init_weights`` (nanoGPT's convention), or a user
``init_fn(model)`` instead — on the *meta*
model under a dispatch mode that records, for every parameter and buffer, the
in-place ATen ops applied to it (``normal_``, ``uniform_``, ``fill_``, ``zero_``,
``mul_`` ...) with their scalar arguments. Those arguments were computed by the
init code from full shapes (fan-in, std), so the sequence is the tensor's init rule.
An op on a view (a padding row zeroed) is recorded with the view's geometry.

``materialize(rules, ...)`` replays a rule for any slice of a tensor: values are
generated in blocks along dim 0 (a row of a matrix; 4096 elements of a vector), each
from its own generator seeded by (seed, name, block), so every element's value is a
function of (seed, name, position) only — the same for every tp/pp/dp layout and for
one process. A shard generates the blocks it intersects and keeps its ranges: peak
memory is the shard plus one block; no full tensor of a sharded parameter is built.

Buffers computed from other tensors (a rotary ``inv_freq`` set by ``copy_``) cannot be
replayed element-wise; they are small and unsharded, so their owning module alone is
materialised on the CPU and its init run there. A *parameter* whose init copies a
computed tensor (``orthogonal_``, ``copy_``) is refused with an error naming it: pass
``init_fn`` that uses element-wise ``torch.nn.init`` functions, or a materialised model.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.ir.shard_spec import ShardKind, ShardSpec

_RANDOM = {"normal_", "uniform_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_"}
_ELEMENTWISE = {"fill_", "zero_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_",
                "erfinv_", "tanh_", "sqrt_", "exp_", "neg_", "abs_", "fmod_", "remainder_"} | _RANDOM
BLOCK_ELEMENTS = 4096
"""A 1-D tensor is generated in blocks of this many elements (a matrix: one row per block)."""


class InitError(ValueError):
    """A meta-device model whose initialisation fxpipe cannot replay shard by shard."""


@dataclass(frozen=True)
class InitOp:
    """One in-place init call recorded on a parameter, replayed block by block."""
    op: str
    """The in-place tensor method (``normal_``, ``fill_``, ...)."""
    args: tuple
    """Its arguments after the tensor itself (numbers only: a tensor argument is refused)."""
    kwargs: tuple
    """Sorted (name, value) pairs, the generator left out (each block gets its own)."""
    view: tuple | None = None
    """(storage offset, shape, stride) relative to the tensor when applied to a view."""


@dataclass(frozen=True)
class InitRules:
    ops: Mapping[str, tuple[InitOp, ...]]
    """Name (every name of a tied group) -> its ops, in order."""
    computed: Mapping[str, torch.Tensor]
    """Buffers computed by their module's init on the CPU (small, never sharded)."""
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, torch.dtype]


def _run_model_init(model: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> None:
    if init_fn is not None:
        init_fn(model)
        return
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    if callable(getattr(model, "init_weights", None)):  # the whole scheme (Hugging Face's, ours)
        model.init_weights()
    elif callable(getattr(model, "_init_weights", None)):  # a per-module rule (nanoGPT convention)
        model.apply(model._init_weights)


def record_init(model: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> InitRules:
    """The init rule of every parameter and buffer of a meta-device ``model``."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        by_storage.setdefault(t.untyped_storage()._cdata, []).append((name, t))
    ops: dict[str, list[InitOp]] = {}
    refused: dict[str, str] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            op = func._schema.name.split("::")[-1]
            target = args[0] if args and isinstance(args[0], torch.Tensor) else None
            owners = by_storage.get(target.untyped_storage()._cdata) if target is not None else None
            if owners and op.endswith("_"):
                name, base = owners[0]
                extra = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
                if op not in _ELEMENTWISE or extra:
                    refused[name] = op
                else:
                    view = None
                    if (target.shape, target.stride(), target.storage_offset()) != \
                            (base.shape, base.stride(), base.storage_offset()):
                        view = (target.storage_offset() - base.storage_offset(), tuple(target.shape),
                                tuple(target.stride()))
                    kw = tuple(sorted((k, v) for k, v in kwargs.items() if k != "generator"))
                    ops.setdefault(name, []).append(InitOp(op, tuple(args[1:]), kw, view))
            return func(*args, **kwargs)

    with torch.no_grad(), Record():
        _run_model_init(model, init_fn)
    computed = _computed_buffers(model, init_fn, {n for n in refused if n in dict(model.named_buffers())})
    rules: dict[str, tuple[InitOp, ...]] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for owners in by_storage.values():
        canonical = owners[0][0]
        if canonical in refused and canonical not in computed:
            raise InitError(f"{canonical}: its init applies {refused[canonical]} with a tensor argument, which "
                            f"cannot be replayed shard by shard on the meta device; pass init_fn= using "
                            f"element-wise torch.nn.init functions, or a materialised model")
        if canonical not in ops and canonical not in computed:
            kind = "parameter" if canonical in params else "buffer"
            raise InitError(f"{kind} {canonical} has no init rule: neither reset_parameters() nor the model's "
                            f"_init_weights sets it on the meta device; pass init_fn=(lambda model: ...) "
                            f"that initialises it, or a materialised model")
        for name, _ in owners:
            rules[name] = tuple(ops.get(canonical, ()))
    return InitRules(rules, computed, {n: tuple(t.shape) for n, t in named}, {n: t.dtype for n, t in named})


def _computed_buffers(model: nn.Module, init_fn: Any, names: set[str]) -> dict[str, torch.Tensor]:
    """Each listed buffer's owning module materialised alone on the CPU and initialised
    there (rotary tables and the like: small, never sharded)."""
    out = {}
    init_weights = getattr(model, "_init_weights", None)
    for name in names:
        path, _, leaf = name.rpartition(".")
        module = model.get_submodule(path)
        if any(True for _ in module.parameters(recurse=False)):
            raise InitError(f"buffer {name} is computed by its module's init, and that module holds parameters "
                            f"too; pass a materialised model")
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            if init_fn is None and callable(init_weights):
                init_weights(module)
        out[name] = getattr(module, leaf).detach().clone()
        module.to_empty(device="meta", recurse=False)
    return out


# ---- replay --------------------------------------------------------------------------------------
def _generator(seed: int, name: str, block: int | str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}\0{name}\0{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _apply(block: torch.Tensor, op: InitOp, gen: torch.Generator | None) -> None:
    kwargs = dict(op.kwargs)
    if op.op in _RANDOM:
        kwargs["generator"] = gen
    getattr(block, op.op)(*op.args, **kwargs)


def _row_block(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows of dim 0 per block, number of blocks)."""
    if len(shape) == 0:
        return 1, 1
    rows = 1 if len(shape) > 1 else BLOCK_ELEMENTS
    return rows, -(-shape[0] // rows) if shape[0] else 0


def _view_values(rules: InitRules, name: str, seed: int, dtype: torch.dtype) -> dict[int, tuple]:
    """For each op applied through a view: the flat positions it covers and the values
    it writes (random ops: drawn once for the whole view, from the view's own stream).
    Computed once per tensor, not per block: O(view size)."""
    out = {}
    for i, op in enumerate(rules.ops[name]):
        if op.view is None:
            continue
        offset, vshape, vstride = op.view
        positions = torch.full((), offset, dtype=torch.long)
        for size, stride in zip(vshape, vstride):
            positions = positions.unsqueeze(-1) + torch.arange(size) * stride
        values = torch.zeros(positions.numel(), dtype=dtype)
        if op.op in _RANDOM or op.op in ("fill_", "zero_"):
            _apply(values, op, _generator(seed, name, f"view/{i}"))
        out[i] = (positions.reshape(-1), values)
    return out


def _block_values(rules: InitRules, name: str, seed: int, b: int, dtype: torch.dtype,
                  views: dict[int, tuple]) -> torch.Tensor:
    """Block ``b`` of tensor ``name`` (rows [b·r, (b+1)·r) of dim 0), fully replayed."""
    shape = rules.shapes[name]
    rows, _ = _row_block(shape)
    if not shape:
        lo, hi = 0, 1
        out = torch.empty((), dtype=dtype)
    else:
        lo, hi = b * rows, min((b + 1) * rows, shape[0])
        out = torch.empty((hi - lo, *shape[1:]), dtype=dtype)
    row_numel = 1
    for d in shape[1:]:
        row_numel *= d
    for i, op in enumerate(rules.ops[name]):
        if op.view is None:
            _apply(out, op, _generator(seed, name, f"{b}/{i}"))
            continue
        covered, values = views[i]  # an op on a view: the positions of it in this block
        inside = (covered >= lo * row_numel) & (covered < hi * row_numel)
        at = covered[inside] - lo * row_numel
        if op.op in _RANDOM or op.op in ("fill_", "zero_"):
            out.view(-1)[at] = values[inside]
        else:  # arithmetic on the current values
            sel = out.view(-1)[at]
            _apply(sel, op, None)
            out.view(-1)[at] = sel
    return out


def materialize_tensor(rules: InitRules, name: str, seed: int, spec: ShardSpec | None = None, tp_rank: int = 0,
                       dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Tensor ``name`` (its ``tp_rank`` shard when ``spec`` splits it, with zero padding
    rows), built block by block: never the full tensor of a sharded parameter."""
    dtype = dtype or rules.dtypes[name]
    if name in rules.computed:
        return rules.computed[name].to(device=device, dtype=dtype)
    shape = rules.shapes[name]
    rows, blocks = _row_block(shape)
    views = _view_values(rules, name, seed, dtype)
    split = spec is not None and spec.kind is not ShardKind.REPLICATED
    if not split:
        if not shape:
            return _block_values(rules, name, seed, 0, dtype, views).to(device)
        out = torch.empty(shape, dtype=dtype, device=device)
        for b in range(blocks):
            out[b * rows:(b + 1) * rows] = _block_values(rules, name, seed, b, dtype, views)
        return out
    out = torch.zeros(spec.local_shape, dtype=dtype, device=device)
    if spec.dim == 0:
        pos = 0
        for a, z in spec.ranges[tp_rank]:  # only the blocks these rows fall in
            for b in range(a // rows, -(-z // rows)):
                vals = _block_values(rules, name, seed, b, dtype, views)
                lo, hi = max(a, b * rows), min(z, (b + 1) * rows)
                out[pos:pos + hi - lo] = vals[lo - b * rows:hi - b * rows]
                pos += hi - lo
        return out
    index = torch.tensor(spec.indices(tp_rank), dtype=torch.long)
    for b in range(blocks):  # every row, keeping this rank's indices of dim `spec.dim`
        vals = _block_values(rules, name, seed, b, dtype, views)
        out[b * rows:(b + 1) * rows].narrow(spec.dim, 0, index.numel()).copy_(
            vals.index_select(spec.dim, index))
    return out


def materialize(model: nn.Module, seed: int = 0, *, init_fn: Callable[[nn.Module], None] | None = None,
                rules: InitRules | None = None) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a meta-device ``model`` as a full CPU tensor, with
    the values any layout's shards hold: a one-process reference. Tied names share one
    tensor. ``model.load_state_dict(materialize(model), assign=True)`` makes it real."""
    rules = rules or record_init(model, init_fn)
    out: dict[str, torch.Tensor] = {}
    by_storage: dict[int, torch.Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        key = t.untyped_storage()._cdata
        if key not in by_storage:
            by_storage[key] = materialize_tensor(rules, name, seed)
        out[name] = by_storage[key]
    return out


def materialize_(model: nn.Module, seed: int = 0, *,
                 init_fn: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Make a meta-device ``model`` real in place (on the CPU), with the values
    ``parallelize(model, seed=seed)`` gives its shards, tied parameters staying one
    ``nn.Parameter`` (``Module.to_empty`` would untie them). The one-process reference
    for deferred-init runs."""
    values = materialize(model, seed, init_fn=init_fn)
    made: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for slots, wrap in ((module._parameters, True), (module._buffers, False)):
            for key, t in list(slots.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    value = values[f"{prefix}.{key}" if prefix else key]
                    made[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if wrap else value
                slots[key] = made[id(t)]
    return model
