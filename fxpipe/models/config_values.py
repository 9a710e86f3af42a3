"""A ``config.json``'s shape fields, checked before transformers sees them, and the
shape a model declares, read before it is built.

transformers' strict config classes answer a hostile value with a traceback of their
own (``num_hidden_layers: "2"``), a ``ZeroDivisionError`` (``num_attention_heads: 0``)
or a negative dimension (``hidden_size: -32``); fxpipe refuses it first, naming the
field and the value. The declared shape (layers, width, vocabulary, a lower bound on
the parameter count) lets the launcher bound a model's size before any search, build
or capture starts (``job/preflight_sizes.py``): a 10,000-layer or 2^20-wide config is
refused in milliseconds instead of hanging the capture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size",
               "num_key_value_heads", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head",
               "n_positions", "n_inner", "ffn_dim", "num_local_experts", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size", "d_model", "num_layers", "num_heads")
"""Integer sizes of the families transformers builds (GPT-2's and OPT's names too);
``null`` is left to the family's default."""


def _sections(doc: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The config and a multimodal one's ``text_config`` (where its language model's sizes are)."""
    out = [("", doc)]
    if isinstance(doc.get("text_config"), dict):
        out.append(("text_config.", doc["text_config"]))
    return out


def check_size_fields(doc: Mapping[str, Any], path: Any) -> None:
    """Each size field present must be a positive integer (JSON true is not one)."""
    for prefix, section in _sections(doc):
        for name in SIZE_FIELDS:
            value = section.get(name)
            if value is None:
                continue
            if type(value) is not int or value <= 0:
                raise ValueError(f"{path}: {prefix}{name} is {value!r} ({_what(value)}); it must be a positive "
                                 f"integer, such as {name}: {_example(name)}")


def _what(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, float):
        return "not a number" if math.isnan(value) else "not an integer"
    return "not positive" if isinstance(value, int) else f"a JSON {type(value).__name__}"


def _example(name: str) -> int:
    return {"vocab_size": 32000, "num_hidden_layers": 32, "n_layer": 12, "num_layers": 12, "max_position_embeddings": 4096,
            "n_positions": 1024}.get(name, 64)


@dataclass(frozen=True)
class DeclaredShape:
    """What a model says of its size before it is built."""
    layers: int
    hidden: int
    vocab: int
    intermediate: int

    @property
    def min_params(self) -> int:
        """A lower bound on the parameter count: per layer the query and output projections
        (2h², every attention has them) and an MLP's two matrices (2hI), plus one embedding
        table (Vh). Used to refuse, so it must never overestimate."""
        return self.layers * (2 * self.hidden ** 2 + 2 * self.hidden * self.intermediate) + self.vocab * self.hidden


def declared_shape(doc: Mapping[str, Any]) -> DeclaredShape | None:
    """The shape a (checked) ``config.json`` declares, or None when it names no layer
    count or width under the usual fields."""
    section = doc["text_config"] if isinstance(doc.get("text_config"), dict) else doc

    def first(*names: str) -> int | None:
        return next((section[n] for n in names if type(section.get(n)) is int), None)

    layers, hidden = first("num_hidden_layers", "n_layer", "num_layers"), first("hidden_size", "n_embd", "d_model")
    if layers is None or hidden is None:
        return None
    vocab = first("vocab_size") or 0
    intermediate = first("intermediate_size", "n_inner", "ffn_dim") or hidden  # every MLP is at least h wide here
    return DeclaredShape(layers=layers, hidden=hidden, vocab=vocab, intermediate=intermediate)
