"""Channel rules for complex views: rotary embeddings written with complex numbers.

Meta's Llama reference rotates query/key channel pairs as complex numbers
(Su et al. 2021, "RoFormer", eq. 34): ``view_as_complex`` reads channels (2j, 2j+1)
as one complex element, a complex multiply rotates it, ``view_as_real`` gives the
pair back. So the complex views carry channels *in pairs*: the two real channels of
one complex element are united (they must live on one rank, as rotate-half unites
its pairs in the real-valued form) and the complex tensor carries that pair's ids;
``view_as_real`` hands them back to both parts. Element-wise complex ops (``polar``,
``complex``, ``real``, ``imag``, conjugation) are element-wise like any other
(``graph_ops.COMPLEX_ELEMENTWISE``). The local op is the same op on the shard, as
long as the (real, imaginary) dim itself is not split, which the union guarantees.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch.fx as fx

from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.channel_ids import Provenance, _align
from fxpipe.passes.tensor_parallel.graph_ops import shape
from fxpipe.passes.tensor_parallel.plan_record import Refuse, TPPlan

VIEW_AS_COMPLEX = G.aten.view_as_complex.default
VIEW_AS_REAL = G.aten.view_as_real.default
VIEWS = frozenset({VIEW_AS_COMPLEX, VIEW_AS_REAL})


def view_ids(prov: Provenance, node: fx.Node, inputs: dict) -> np.ndarray:
    """(..., 2) real ids -> (...) complex ids, the pair united; (...) -> (..., 1)."""
    ids = _align(inputs[node.args[0].name], len(shape(node.args[0])))
    if node.target is VIEW_AS_REAL:
        return np.expand_dims(ids, -1)
    if ids.shape[-1] > 1:
        prov.union(ids[..., :1], ids[..., 1:])
    return ids[..., 0]


def view_rule(plan: TPPlan, prov: Provenance, node: fx.Node, lay: Any,
              grad: frozenset[str], where: str) -> None:
    """The same view of the shard, unless the (real, imaginary) dim is split (never, when
    the pair's union held; a check, not a rewrite)."""
    real = plan.layouts[node.args[0].name] if node.target is VIEW_AS_COMPLEX else plan.layouts[node.name]
    if len(real.full) - 1 in real.sharded:
        raise Refuse("splits the real and imaginary parts of a complex number")
