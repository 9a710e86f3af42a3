"""Tables of ATen ops by what they do to values: the passes, the cost model and the
token-input analysis read the same sets (one definition each)."""
from __future__ import annotations

import torch

aten = torch.ops.aten


# Ops that only re-describe memory: no FLOPs, no traffic (a cut still sends their output).
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
    aten.permute.default, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.alias.default,
    aten.detach.default, aten.unflatten.int, aten.flatten.using_ints, aten.unbind.int,
    aten.view_as.default, aten.as_strided.default, aten.to.dtype_layout, aten.to.dtype,
    aten._assert_tensor_metadata.default, aten.lift_fresh_copy.default,
})


# dtype casts: ``w.to(x.dtype)``, ``w.type_as(x)``, ``w.float()`` (``passes/weight_views.py``
# sees a parameter through them; the vocabulary chain records them as casts).
CASTS = frozenset({aten.to.dtype, aten.type_as.default, aten._to_copy.default, aten.to.dtype_layout})


# Ops whose output holds only values of their (first) input: bounds carry through.
VALUE_PRESERVING = VIEW_OPS | {aten.clone.default, aten._to_copy.default, aten.contiguous.default,
                                aten.copy.default}
