"""The tiny GPT ``fxpipe calibrate`` runs through fxpipe's own runtime: what the
runtime costs per action and per transfer is measured on it (``machine_speeds.py``,
``transfer_speeds.py``)."""
from __future__ import annotations

from typing import Any

import torch

from fxpipe.compiler.pipeline import compile_pipeline
from fxpipe.ir.artifact import CompiledPipeline
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.gpt import GPT, GPTConfig
from fxpipe.params.rank_state import ShardBuilder
from fxpipe.runtime.api import ParallelModel
from fxpipe.runtime.build import build_runtime
from fxpipe.runtime.rank_mesh import RankMesh


def tiny_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 rows of 8 tokens and their targets, vocabulary 32 (from torch's current seed)."""
    return torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))


def tiny_runtime(layers: int, batch: tuple[torch.Tensor, ...],
                  **layout: Any) -> tuple[CompiledPipeline, ParallelModel]:
    """(compiled, ParallelModel) of a tiny GPT (h=16, ``layers`` layers, tied head) laid out
    by ``layout`` on the CPU preset's cost model, built by the real runtime in this
    process's world (a world of one is made when there is none)."""
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=layers, n_head=2, n_embd=16))
    config = ParallelConfig(costs="model", partition="uniform", hardware="cpu", **layout)
    mesh = RankMesh.join(config, torch.device("cpu"))
    rows = batch[0].shape[0] // config.num_microbatches
    compiled = compile_pipeline(model, tuple(t[:rows] for t in batch), mesh.config, device="cpu")
    shards = ShardBuilder(compiled.program, {}, model, tp_rank=0, device=torch.device("cpu"))
    return compiled, build_runtime(compiled, mesh, shards, model=model)
