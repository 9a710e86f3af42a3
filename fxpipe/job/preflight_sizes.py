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


def memory_here() -> tuple[int, str]:
    """What one rank's training state must fit in, in bytes and in words: one GPU's
    memory, or on CPUs the memory free on this machine now (shared by its local ranks)."""
    import torch

    if torch.cuda.is_available():
        have = torch.cuda.get_device_properties(0).total_memory
        return have, f"one GPU's {have / 2**30:,.1f} GiB"
    have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return have, f"the {have / 2**30:,.1f} GiB free on this machine"


def check_state_bound(model: str, shape: DeclaredShape | None, world: int) -> None:
    """The least training state any layout of ``world`` ranks needs, against what it will
    have: per GPU 1/world of it, on CPUs all of it in this machine's free memory (local
    ranks). The exact check, per layout, follows the capture (``check_state_fits``)."""
    import torch

    if shape is None:
        return
    params = shape.min_params
    total = params * STATE_BYTES_PER_PARAM
    have, where = memory_here()
    if torch.cuda.is_available():
        need = total / world
        where += f" (the state spread over all {world} ranks)"
    else:  # under torchrun across nodes each node holds its ranks' share
        need = total * min(local_world_size(world), world) / world
    if need > have:
        raise PreflightError(f"--model {model} has at least {params:,} parameters ({shape.layers} layers, width "
                             f"{shape.hidden}, vocabulary {shape.vocab}), whose training state needs at least "
                             f"{need / 2**30:,.1f} GiB ({STATE_BYTES_PER_PARAM} bytes each: fp32 weights, gradients "
                             f"and Adam's moments), more than {where}: use a smaller model, more ranks or more "
                             f"machines")
