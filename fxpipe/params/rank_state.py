"""This rank's parameters: each built once, at its local (tensor-parallel) shape.

A rank never holds a full tensor of a sharded parameter: each shard is read from a
Hugging Face directory (``fxpipe/params/hf_weights.py``, only its byte ranges), replayed from
the model's own init rules for a meta-device model (``fxpipe/params/deferred_init.py``), or sliced
from the captured state (``ShardSpec`` index ranges) when the model was built
with weights.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable

import torch
import torch.nn as nn

from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.shard_spec import shard_state
from fxpipe.ir.state_mismatch import full_shapes
from fxpipe.params.deferred_init import materialize_tensor, record_init
from fxpipe.params.hf_weights import WeightsDir


def stored_weights(program: Program, specs: dict, directory) -> dict:
    """Canonical name -> (WeightsDir, stored name) for every parameter, checked against
    the model's names, full shapes and dtypes first (one error listing every mismatch)."""

    wd = WeightsDir(directory)
    return {c: (wd, s) for c, s in check_weights(wd, program, specs).items()}


def check_weights(wd, program: Program, specs: dict) -> dict[str, str]:
    """``WeightsDir.check`` against ``program`` (the launcher's preflight calls it too)."""

    names = {p.name: p.canonical for p in program.params if p.kind is not ParamKind.CONSTANT}
    required = {p.canonical for p in program.params if p.kind is ParamKind.PARAMETER}
    dtypes = {p.canonical: p.dtype for p in program.params if p.kind is not ParamKind.CONSTANT}
    return wd.check(names, full_shapes(program, specs), required, dtypes)


class ShardBuilder:
    """Builds (tensor, fp32 copy or None) per canonical name on ``device``; the fp32 copy
    exists where the tensor was built in fp32 first (the masters under mixed precision)."""

    def __init__(self, program: Program, specs: dict, model: nn.Module, *, tp_rank: int,
                 device: torch.device, seed: int = 0, weights: str | os.PathLike | None = None,
                 init_fn: Callable[[nn.Module], None] | None = None) -> None:
        self.program, self.specs, self.model = program, specs, model
        self.tp_rank, self.device, self.seed = tp_rank, device, seed
        self.weights, self.init_fn = weights, init_fn
        self.built: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._rules: list = []

    def with_specs(self, specs: dict) -> "ShardBuilder":
        """A builder of the same sources for other specs (a pipeline rank's rows folded
        in, ``ir/shard_spec.rank_specs``); what was built under an unchanged spec is kept."""
        out = ShardBuilder(self.program, specs, self.model, tp_rank=self.tp_rank, device=self.device,
                           seed=self.seed, weights=self.weights, init_fn=self.init_fn)
        out.built = {n: v for n, v in self.built.items() if specs.get(n) == self.specs.get(n)}
        out._rules = self._rules
        self.built.clear()  # what the cost measurement built under the old specs is not kept twice
        return out

    def deferred(self, names: Iterable[str]) -> bool:
        """Whether these tensors come from elsewhere than the captured state."""
        return self.weights is not None or any(self.program.state[n].is_meta for n in names)

    def shard(self, name: str) -> torch.Tensor:
        """``name``'s shard of the captured state (the model was built with weights)."""
        return shard_state({name: self.program.state[name]}, self.specs, self.tp_rank)[name]

    def build(self, names: Iterable[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        names = list(names)
        state, specs = self.program.state, self.specs
        todo = [n for n in names if n not in self.built]
        stored = stored_weights(self.program, specs, self.weights) if self.weights is not None and todo else {}
        if not self._rules and any(n not in stored and state[n].is_meta for n in todo):
            self._rules.append(record_init(self.model, self.init_fn))
        for n in todo:
            f32 = None
            if n in stored:
                f32 = stored[n][0].read(stored[n][1], specs.get(n), self.tp_rank, torch.float32).to(self.device)
            elif state[n].is_meta:
                f32 = materialize_tensor(self._rules[0], n, self.seed, specs.get(n), self.tp_rank,
                                         torch.float32, self.device)
            elif self.weights is not None:  # a buffer of a materialised model the directory does not hold
                f32 = self.shard(n).float()
            t = f32.to(state[n].dtype) if f32 is not None else self.shard(n)
            self.built[n] = (t.detach().to(self.device).clone().requires_grad_(state[n].requires_grad), f32)
        return {n: self.built[n] for n in names}

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {n: t for n, (t, _) in self.build(names).items()}

    def forget(self) -> None:
        """Drop what was built (tensors timed by the cost profile that this rank does not keep)."""
        self.built.clear()
