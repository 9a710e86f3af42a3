"""``--model DIR``: a Hugging Face model directory (``config.json``, with or without
safetensors), built on the meta device from its config.

No weights are allocated here: ``AutoModelForCausalLM.from_config`` under
``torch.device("meta")`` gives the module tree and shapes, and each rank then takes
only its shards — from the directory's safetensors through the slice reader
(``fxpipe/params/hf_weights.py``, ``parallelize(weights=DIR)``), or, for a directory without
weights, from the model's own init scheme applied shard by shard (``fxpipe/params/deferred_init.py``).
The batch follows nanoGPT's convention (inputs, next tokens) so all ``seq`` positions
are trained (``next_token_loss``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from fxpipe.base.safe_io import read_json_object, refuse_remote_code
from fxpipe.models.config_values import check_size_fields, declared_shape
from fxpipe.models.losses import next_token_loss
from fxpipe.models.workload import Workload, _token_batch
from fxpipe.params.hf_weights import INDEX, MAX_CONFIG_BYTES, SINGLE


def is_model_dir(name: str) -> bool:
    """Whether ``--model`` names a directory holding a config.json."""
    return Path(name).is_dir() and (Path(name) / "config.json").exists()


def has_weights(directory: str) -> bool:
    return any((Path(directory) / f).exists() for f in (SINGLE, INDEX))


PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
"""Weight files fxpipe never loads (pickles can run code): a directory holding only these
is refused rather than trained from a random initialisation."""


def check_weights_readable(directory: str) -> None:
    """A model directory whose weights exist only as pickles is refused, naming one."""
    if has_weights(directory):
        return
    found = sorted(p.name for pattern in PICKLED_WEIGHTS for p in Path(directory).glob(pattern))
    if found:
        raise ValueError(f"{directory} holds its weights as {found[0]}"
                         f"{f' and {len(found) - 1} more' if len(found) > 1 else ''} (pickle), which fxpipe "
                         f"does not load; save them as safetensors (model.save_pretrained(DIR)) or pass "
                         f"--init-from a safetensors directory")


def load_config(directory: str):
    """The directory's ``PretrainedConfig``, refused unless a causal LM transformers knows
    (no remote code is run: ``trust_remote_code`` stays off)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(directory) / "config.json"
    doc = read_json_object(path, MAX_CONFIG_BYTES)
    if not isinstance(doc.get("model_type"), str):
        raise ValueError(f"{path} has no 'model_type'; it must be a Hugging Face config.json (save_pretrained)")
    refuse_remote_code(doc, path)
    check_size_fields(doc, path)  # naming the field, before transformers' own checks
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001  (strict dataclasses raise TypeError, StrictDataclassError, ...)
        raise ValueError(f"--model {directory}: transformers cannot read its config.json "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(f"--model {directory}: config.json is a {doc['model_type']!r} model "
                         f"({type(config).__name__}), not a causal language model; fxpipe run trains models "
                         f"AutoModelForCausalLM can build (llama, gpt2, qwen2, mistral, ...)")
    return config


def vocab_size(config) -> int:
    return int(config.get_text_config().vocab_size)


def config_layers(config) -> int:
    """The decoder's layer count (``num_hidden_layers``, GPT-2's ``n_layer`` by its alias)."""
    return int(config.get_text_config().num_hidden_layers)


def with_layers(config, layers: int):
    """``config`` cut to its first ``layers`` layers (the planner captures a few and
    extrapolates; per-layer lists such as ``layer_types`` are cut alike)."""
    text = config.get_text_config()
    text.num_hidden_layers = layers
    types = getattr(text, "layer_types", None)
    if isinstance(types, list):
        text.layer_types = types[:layers]
    return config


def build_model(directory: str, device: torch.device | str = "meta", *,
                layers: int | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = load_config(directory)
    if layers is not None:
        config = with_layers(config, layers)
    config.use_cache = False  # no KV cache in training (and none to capture)
    # transformers' advice while building (BERT's "add is_decoder=True") would break the
    # one line a refusal is: what matters is checked on the graph (passes/causality.py).
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001  (a value the family's code cannot build: ZeroDivisionError, ...)
        raise ValueError(f"--model {directory}: transformers cannot build a model from its config.json "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    finally:
        hf_logging.set_verbosity(level)
    # fp32 parameters whatever the files store (a bf16 checkpoint widens on load):
    # --precision chooses the compute dtype, the masters stay fp32.
    return model.to(torch.float32)


def dir_workload(directory: str, *, batch: int, seq: int, device: torch.device | str, seed: int,
                 layers: int | None = None):

    model = build_model(directory, device, layers=layers)
    vocab = vocab_size(model.config)
    x = _token_batch(batch, seq + 1, vocab, device, seed)
    return Workload(model, (x[:, :-1].contiguous(), x[:, 1:].contiguous()), next_token_loss, None,
                    vocab_size=vocab)


def declared_dir_shape(directory: str):
    """The shape a model directory's config.json declares (``models/config_values.py``),
    its size fields checked, without building the model or asking transformers."""
    path = Path(directory) / "config.json"
    doc = read_json_object(path, MAX_CONFIG_BYTES)
    check_size_fields(doc, path)
    return declared_shape(doc)
