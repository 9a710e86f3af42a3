"""A checkpoint of every way a model arrives resumes in another layout: a Hugging Face
config directory with and without weights, and a Mixtral directory, each built on the
meta device as `fxpipe run` builds them (the materialised sources resume across
layouts in test_checkpoint.py's worlds: the registry's gpt-tiny, hf:gpt2 and
tests.runtime._wide_vocab:workload as module:fn; a zoo model is materialised the same
way and saves every buffer it holds). One spawned world of 2 runs every source
(_source_resume.py) (three models, three captures per rank)."""
from __future__ import annotations

import pytest
import torch

from tests.runtime._dist import run_world
from tests.checkpoint._source_resume import world_sources
from tests.models._model_dirs import _mixtral_dir


def _llama_dir(path, weights: bool):
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path) if weights else cfg.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_every_model_source_resumes_in_another_layout(tmp_path):
    """A Llama directory built on meta never materialises ``rotary_emb.original_inv_freq``
    (a non-persistent buffer no stage reads), so its checkpoint lacks it: the load
    must not expect it (it was refused as "missing: model.rotary_emb.original_inv_freq")."""
    bare, full = _llama_dir(tmp_path / "llama", False), _llama_dir(tmp_path / "llama_w", True)
    mixtral = _mixtral_dir(tmp_path / "mixtral")
    sources = [(bare, None), (full, full), (mixtral, mixtral)]
    ranks = run_world(2, world_sources, str(tmp_path), sources)
    for (name, weights), (saved, loaded, fresh) in zip(sources, ranks[0]):
        assert loaded == pytest.approx(saved, abs=1e-5), name  # dp=2 reduces in another order
        assert abs(fresh - saved) > 1e-3, f"{name}: the fresh model already had the saved loss"
    assert ranks[0] == ranks[1]
