"""Checkpoints in the layout transformers converts on load: per-expert tensors on disk,
one stacked tensor in the model.

transformers (5.x) builds an MoE's experts as stacked weights — ``mlp.experts.gate_up_proj``
of shape (E, 2I, H) — while checkpoints on disk, its own ``save_pretrained`` of Mixtral
included, keep one tensor per expert and projection (``block_sparse_moe.experts.3.w1.weight``).
On load it renames and merges them by the model type's conversion mapping
(``transformers.conversion_mapping``: ``WeightRenaming`` and ``WeightConverter`` with
``MergeModulelist`` / ``Concatenate``). Here the same mapping is read, never run: each
stacked model tensor becomes a ``StackedTensor`` recipe over the stored names, and a rank
reads only its region of it — the experts it owns, or its tensor-parallel range of the
concatenated axis — expert by expert, part by part, so no rank ever holds a whole stacked
tensor it shards. A conversion using another operation is not applied (the names then
stay unmatched and the weights check lists them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

_INDEX = re.compile(r"\\\*")


@dataclass(frozen=True)
class StackedTensor:
    """A model tensor stacked from stored per-expert tensors: ``parts[j][e]`` is the stored
    name of source j, expert e; sources concatenated along ``concat_dim`` of the stacked
    tensor (None: one source)."""
    parts: tuple[tuple[str, ...], ...]
    concat_dim: int | None
    part_shape: tuple[int, ...]
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        shape = [len(self.parts[0]), *self.part_shape]
        if self.concat_dim is not None:
            shape[self.concat_dim] *= len(self.parts)
        return tuple(shape)

    def names(self) -> list[str]:
        return [n for part in self.parts for n in part]

    def region(self, read: Callable[[str, tuple[slice, ...]], torch.Tensor], dim: int, start: int,
               stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dimension ``dim`` (every other dimension whole), read
        through ``read(stored name, index)`` one stored tensor's region at a time."""
        full = [slice(0, n) for n in self.shape]
        full[dim] = slice(start, stop)
        experts = range(full[0].start, full[0].stop)
        width = self.part_shape[self.concat_dim - 1] if self.concat_dim is not None else None
        out = None  # filled expert by expert: the region and one expert's pieces at a time
        for i, e in enumerate(experts):
            pieces = []
            for j, part in enumerate(self.parts):
                index = list(full[1:])
                if self.concat_dim is not None:
                    c = full[self.concat_dim]
                    lo, hi = max(c.start, j * width), min(c.stop, (j + 1) * width)
                    if lo >= hi:
                        continue
                    index[self.concat_dim - 1] = slice(lo - j * width, hi - j * width)
                pieces.append(read(part[e], tuple(index)))
            one = torch.cat(pieces, dim=self.concat_dim - 1) if len(pieces) > 1 else pieces[0]
            if out is None:
                out = one.new_empty((len(experts), *one.shape))
            out[i] = one
            del pieces, one
        return out


def _source_regex(pattern: str) -> re.Pattern | None:
    """A converter's source (``.experts.*.w1.weight``) as a regex matching a stored name's
    end, its ``*`` the expert index; None for a pattern with other regex syntax."""
    if re.search(r"[\\\[\]()+?{}|^$]", pattern):
        return None
    return re.compile(_INDEX.sub(r"(\\d+)", re.escape(pattern)) + "$")


def conversions(model_type: str | None, stored: Mapping[str, tuple[tuple[int, ...], str]]
                ) -> tuple[dict[str, str], dict[str, StackedTensor]]:
    """For the stored (name -> (shape, dtype)) of a checkpoint of ``model_type``: the model
    names of renamed tensors (model name -> stored name) and the stacked tensors built from
    per-expert ones (model name -> recipe). Both empty when the type has no mapping or
    nothing stored matches it."""
    if not model_type:
        return {}, {}
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return {}, {}
    transforms = get_checkpoint_conversion_mapping(model_type) or []
    renamed = {name: name for name in stored}  # stored -> model name
    for t in transforms:
        if type(t).__name__ != "WeightRenaming":
            continue
        for source, target in zip(t.source_patterns, t.target_patterns):
            renamed = {k: re.sub(source, target, v) for k, v in renamed.items()}
    by_model = {v: k for k, v in renamed.items()}
    stacked: dict[str, StackedTensor] = {}
    for t in transforms:
        if type(t).__name__ != "WeightConverter" or len(t.target_patterns) != 1:
            continue
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in t.operations]
        if not ops or ops[0] != ("MergeModulelist", 0) or any(name != "Concatenate" for name, _ in ops[1:]) \
                or len(ops) > 2 or (len(ops) == 2) != (len(t.source_patterns) > 1):
            continue
        concat = ops[1][1] if len(ops) == 2 else None
        regexes = [_source_regex(p) for p in t.source_patterns]
        if None in regexes:
            continue
        found: dict[str, dict[int, dict[int, str]]] = {}  # prefix -> source -> expert -> model name
        for name in by_model:
            for j, rx in enumerate(regexes):
                m = rx.search(name)
                if m:
                    found.setdefault(name[:m.start()], {}).setdefault(j, {})[int(m.group(1))] = name
        for prefix, sources in found.items():
            if len(sources) != len(regexes):
                continue
            counts = {len(experts) for experts in sources.values()}
            experts = sorted(next(iter(sources.values())))
            if len(counts) != 1 or experts != list(range(len(experts))) or \
                    any(sorted(s) != experts for s in sources.values()):
                continue
            parts = tuple(tuple(by_model[sources[j][e]] for e in experts) for j in range(len(regexes)))
            shapes = {stored[n][0] for part in parts for n in part}
            dtypes = {stored[n][1] for part in parts for n in part}
            if len(shapes) != 1 or len(dtypes) != 1:
                continue
            target = prefix + t.target_patterns[0].lstrip("^")
            stacked[target] = StackedTensor(parts, concat, next(iter(shapes)), next(iter(dtypes)))
    used = {n for s in stacked.values() for n in s.names()}
    renames = {model: name for name, model in renamed.items() if name not in used and model != name}
    return renames, stacked
