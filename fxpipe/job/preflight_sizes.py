"""Sizes bounded before work: what a model declares (layers, width, vocabulary, a lower
bound on its parameters) is compared with what capture, search and this machine can
handle before any search, build or capture starts.

Without it a 10,000-layer or 2^20-wide config.json hung ``fxpipe run`` and ``fxpipe
plan`` in the capture, 10^6 layers grew ``plan`` past 4 GB, and an 81.6B-parameter
config searched layouts for minutes before the state-size check (``preflight.py``'s
``check_state_fits``, exact but after a capture) refused it. The numbers here come
from the config alone (``models/config_values.py``), so the refusal takes milliseconds.
The layout search's own time and candidate bounds are the planner's
(``planner/auto_layout.py``); schedule sizes are ``schedules/registry.check_size``'s.
"""
from __future__ import annotations

import os

from fxpipe.job.preflight_files import PreflightError
from fxpipe.models.config_values import DeclaredShape
from fxpipe.models.hf_dir import declared_dir_shape, is_model_dir
from fxpipe.models.registry import GPT_CONFIGS
from fxpipe.runtime.launch import local_world_size

MAX_LAYERS = 1024
"""Capture and the per-layer passes grow with the layer count (a 10^6-layer graph is
gigabytes); the largest published dense models have ~130 layers."""
MAX_HIDDEN = 2**17
"""Width: 131,072 (the largest published models are 25,600 wide); 2^20 is refused."""
MAX_VOCAB = 2**22
"""Vocabulary rows: 4,194,304 (the largest published vocabularies are ~260,000)."""
STATE_BYTES_PER_PARAM = 16
"""fp32 weights, gradients and Adam's two moments: the least any layout keeps per parameter
over all the ranks (ZeRO-1 shards only the optimizer part of it)."""


def declared(model: str, layers: int | None = None) -> DeclaredShape | None:
    """The shape ``model`` declares before it is built: a registry GPT's config (with a
    ``--layers`` override), a model directory's config.json; None for models built by
    code (``hf:``, ``zoo:``, ``module:fn``), whose size is known only once built."""
    cfg = GPT_CONFIGS.get(model)
    if cfg is not None:
        return DeclaredShape(layers=layers or cfg.n_layer, hidden=cfg.n_embd, vocab=cfg.vocab_size,
                             intermediate=4 * cfg.n_embd)
    if is_model_dir(model):
        try:
            return declared_dir_shape(model)
        except (OSError, ValueError) as exc:
            raise PreflightError(str(exc)) from None
    return None


def check_shape(model: str, layers: int | None = None) -> DeclaredShape | None:
    """Layers, width and vocabulary within what capture and search handle (one line,
    naming the field, the value and the bound)."""
    shape = declared(model, layers)
    if shape is None:
        return None
    for what, value, limit in (("layers", shape.layers, MAX_LAYERS), ("hidden width", shape.hidden, MAX_HIDDEN),
                               ("vocabulary", shape.vocab, MAX_VOCAB)):
        if value > limit:
            raise PreflightError(f"--model {model} declares {value:,} {what}; fxpipe captures and searches models "
                                 f"of at most {limit:,} {what} (capture and the per-layer passes would take hours "
                                 f"and gigabytes): use a smaller config")
    return shape


def state_room(total: float, shards: int, ranks: int) -> tuple[float, float, str]:
    """(need, have, where) for ``total`` bytes of training state cut into ``shards`` equal
    shares, one per rank: on GPUs one share against one device's memory; on this
    machine's CPUs the shares of every local rank (``LOCAL_WORLD_SIZE`` of ``ranks``, all
    of them when fxpipe starts them) against the memory free now. Under torchrun across
    nodes each node checks its own ranks. ``where`` names what was compared with."""
    import torch

    share = total / shards
    if torch.cuda.is_available():
        have = torch.cuda.get_device_properties(0).total_memory
        return share, have, f"one GPU's {have / 2**30:,.1f} GiB"
    local = min(local_world_size(ranks), ranks)
    have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return share * local, have, f"the {have / 2**30:,.1f} GiB free on this machine ({local} rank(s) here)"


def check_state_bound(model: str, shape: DeclaredShape | None, world: int) -> None:
    """The least training state any layout of ``world`` ranks needs (spread over all of
    them), against what it will have (``state_room``). The exact check, per layout,
    follows the capture (``preflight.check_state_fits``)."""
    if shape is None:
        return
    params = shape.min_params
    need, have, where = state_room(params * STATE_BYTES_PER_PARAM, world, world)
    if need > have:
        raise PreflightError(f"--model {model} has at least {params:,} parameters ({shape.layers} layers, width "
                             f"{shape.hidden}, vocabulary {shape.vocab}), whose training state needs at least "
                             f"{need / 2**30:,.1f} GiB ({STATE_BYTES_PER_PARAM} bytes each: fp32 weights, gradients "
                             f"and Adam's moments; spread over all {world} ranks), more than {where}: use a smaller "
                             f"model, more ranks or more machines")
