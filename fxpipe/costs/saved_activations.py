"""Activation memory per microbatch, measured as the bytes autograd saves for backward.

Every tensor autograd keeps for backward passes through the pack hook of
``torch.autograd.graph.saved_tensors_hooks``, on any device, so this measures
what a forward really holds — the quantity Korthikanti et al. 2022 count in
"activation memory per layer" — without a memory allocator or a GPU. Rules:

- a storage is counted once, at its full size: q, k and v sliced from one fused
  QKV projection are one allocation (keyed by ``untyped_storage().data_ptr()``);
- parameters and buffers are not activations: their storages (and views of them,
  such as the ``Wᵀ`` a linear saves) are excluded;
- inside a recomputed region (``ir/recompute_region.py``) the body runs without a
  graph and keeps nothing; the region's inputs, which it does keep, reach ours;
- each storage is attributed to the node whose execution saved it first
  (``measure_saved`` runs the graph node by node with an fx Interpreter), and
  nodes to layers by ``Program.layers`` (or a region's ``fxpipe_layer`` tag).

Typical use for one pipeline stage's microbatch in the runtime::

    with SavedTensorCounter(exclude=state.values()) as saved:
        out = stage.call(state, canonical, batch, received)
    activation_bytes = saved.total
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Hashable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx

from fxpipe.passes.recompute import LAYER_KEY


def _storage_key(t: torch.Tensor) -> tuple[Hashable, int]:
    """(identity of t's allocation, its size in bytes)."""
    if t.device.type == "meta":
        raise ValueError("saved-tensor bytes are measured on real tensors; meta tensors have no "
                         "storage — run on CPU (or any device) with a small batch, or use the "
                         "cost pass's estimate for meta-device programs")
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
        return ("tensor", id(t)), t.numel() * t.element_size()
    return (t.device, storage.data_ptr()), storage.nbytes()


class SavedTensorCounter:
    """Context manager: counts the bytes autograd saves for backward while active.

    ``tag`` (set by the caller, e.g. to the running node's name) is what each newly
    seen storage is attributed to in ``by_tag``. Saved tensors are referenced until
    exit so that no counted address is freed and reused during the count."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t)[0] for t in exclude}
        self._seen: set[Hashable] = set()
        self._keep: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.tag: Hashable = None
        self.by_tag: dict[Hashable, int] = {}

    @property
    def total(self) -> int:
        return sum(self.by_tag.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage_key(t)
        if key not in self._excluded and key not in self._seen:
            self._seen.add(key)
            self._keep.append(t.detach())
            self.by_tag[self.tag] = self.by_tag.get(self.tag, 0) + nbytes
        # Detached: a saved output returned as itself would hold its own grad_fn, a
        # cycle through C++ that Python's gc cannot collect (the graph would leak).
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "SavedTensorCounter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._keep.clear()


class _NodeTagger(fx.Interpreter):
    """Runs a GraphModule node by node, tagging the counter with the running node."""

    def __init__(self, gm: fx.GraphModule, counter: SavedTensorCounter) -> None:
        super().__init__(gm)
        self.counter = counter

    def run_node(self, n: fx.Node) -> Any:
        self.counter.tag = n.name
        return super().run_node(n)


@dataclass(frozen=True)
class SavedTensorReport:
    """Bytes saved for backward by one forward (one microbatch)."""
    by_node: Mapping[str, int]
    """Node name -> bytes of the storages it saved first."""
    by_layer: Mapping[int | None, int]
    """Layer index -> bytes (None: outside every layer: embeddings, head, loss)."""

    @property
    def total(self) -> int:
        return sum(self.by_node.values())


def layer_of(node: fx.Node, layers: Mapping[str, int]) -> int | None:
    """A node's layer: from the capture's map, or the tag recompute puts on regions."""
    return layers.get(node.name, node.meta.get(LAYER_KEY))


def measure_saved(gm: fx.GraphModule, args: Sequence[Any], layers: Mapping[str, int], *,
                  exclude: Iterable[torch.Tensor] = ()) -> SavedTensorReport:
    """Run ``gm(*args)`` with grad enabled and report the bytes saved for backward.

    Parameters and buffers are excluded: the arguments whose placeholders capture
    tagged as parameters/buffers/constants (``fxpipe_fqn``; ``split_pass`` keeps
    the tag), plus any tensor in ``exclude`` (for graphs built by hand)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise TypeError(f"the graph takes {len(placeholders)} inputs, got {len(args)} args")
    state = [a for a, ph in zip(args, placeholders)
             if "fxpipe_fqn" in ph.meta and isinstance(a, torch.Tensor)]
    counter = SavedTensorCounter(exclude=[*state, *exclude])
    with torch.enable_grad(), counter:
        _NodeTagger(gm, counter).run(*args)
    by_node = {str(k): v for k, v in counter.by_tag.items()}
    nodes = {n.name: n for n in gm.graph.nodes}
    by_layer: dict[int | None, int] = {}
    for name, nbytes in by_node.items():
        k = layer_of(nodes[name], layers)
        by_layer[k] = by_layer.get(k, 0) + nbytes
    return SavedTensorReport(by_node=MappingProxyType(by_node), by_layer=MappingProxyType(by_layer))


def saved_bytes_by_layer(gm: fx.GraphModule, args: Sequence[Any], layers: Mapping[str, int], *,
                         exclude: Iterable[torch.Tensor] = ()) -> dict[int | None, int]:
    """Layer index (None: outside layers) -> bytes saved for backward by one forward."""
    return dict(measure_saved(gm, args, layers, exclude=exclude).by_layer)
