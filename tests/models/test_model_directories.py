"""Model directories: what a ``config.json`` says is checked before workers (positions, state size,
a causal LM), and MoE and Mixtral directories train, from a config alone or from the weights
transformers saved."""
from __future__ import annotations


import pytest

from tests.job._cli import RUN, refused
from tests.models._model_dirs import llama_config, mixtral_64_dir


def _token_batch():
    """Four rows of 16 token ids (seed 0) and their next tokens."""
    import torch

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 17))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _config_only_world(rank, world, directory):
    import math

    from fxpipe.models.hf_dir import build_model
    from fxpipe.models.losses import next_token_loss
    from fxpipe.parallel import parallelize

    batch = _token_batch()
    pm = parallelize(build_model(directory), example_inputs=batch, loss_fn=next_token_loss, pp=2, microbatches=2,
                     costs="model", partition="uniform")
    loss = pm.train_step(batch)
    pm.close()
    return math.isfinite(loss)


def _mixtral_world(rank, world, directory):
    from fxpipe.models.hf_dir import build_model
    from fxpipe.models.losses import next_token_loss
    from fxpipe.parallel import parallelize

    batch = _token_batch()
    pm = parallelize(build_model(directory), example_inputs=batch, loss_fn=next_token_loss, weights=directory,
                     pp=2, microbatches=2, costs="model", partition="uniform")
    loss = pm.train_step(batch)
    pm.close()
    return loss


def test_seq_beyond_the_models_positions_is_refused_before_workers(tmp_path, monkeypatch, capsys):
    d = llama_config(tmp_path / "m", max_position_embeddings=8)
    argv = [a for a in RUN if a != "gpt-tiny"]
    argv.insert(argv.index("--model") + 1, str(d))
    refused(argv, monkeypatch, capsys, f"--seq 16 exceeds the 8 positions of {d}", "use --seq <= 8")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_an_moe_config_directory_trains(tmp_path, family):
    """Built on meta and initialised shard by shard, its grouped experts' token counts
    traced on the GPU branch (histc of integers), which the device pass turns into the
    CPU's (passes/device.py)."""
    import transformers

    from tests.runtime._dist import run_world

    d = tmp_path / family
    shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=64, num_experts_per_tok=2)
    if family == "mixtral":
        transformers.MixtralConfig(intermediate_size=128, num_local_experts=4, **shape).save_pretrained(d)
    else:
        transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_experts=4,
                                    **shape).save_pretrained(d)
    assert run_world(2, _config_only_world, str(d)) == [True, True]


def test_a_model_whose_state_cannot_fit_is_refused_before_workers(tmp_path, monkeypatch, capsys):
    d = llama_config(tmp_path / "huge", num_hidden_layers=2, hidden_size=1 << 16, intermediate_size=1 << 16,
                      num_attention_heads=32, num_key_value_heads=32)
    argv = [a for a in RUN if a != "gpt-tiny"]
    argv.insert(argv.index("--model") + 1, str(d))
    # Refused from the config's sizes before the capture (job/preflight_sizes.py; the exact
    # per-layout check after the capture is check_state_fits).
    err = refused(argv, monkeypatch, capsys, "parameters (2 layers, width 65536, vocabulary 300)",
                   "training state needs at least", "(16 bytes each", "GiB free on this machine")
    assert "use a smaller model, more ranks" in err


@pytest.mark.slow
def test_a_mixtral_saved_by_transformers_trains_from_its_weights(tmp_path):
    import transformers

    from fxpipe.models.losses import next_token_loss
    from tests.runtime._dist import run_world

    d = mixtral_64_dir(tmp_path / "mixtral")
    losses = run_world(2, _mixtral_world, str(d))
    # The eager model from the same directory, run once here rather than on every rank.
    batch = _token_batch()
    eager = transformers.MixtralForCausalLM.from_pretrained(d)
    expected = next_token_loss(eager(batch[0], use_cache=False), batch[1]).item()
    assert len(losses) == 2
    for loss in losses:
        assert loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("decoder", [False, True])
def test_a_bidirectional_encoder_is_refused_as_a_causal_lm(tmp_path, monkeypatch, capsys, decoder):
    """BERT through AutoModelForCausalLM without is_decoder attends both ways: its targets
    would be in its inputs. The attention mask is read off the captured graph."""
    import transformers

    from tests.job._cli import launched

    d = tmp_path / "bert"
    transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                            vocab_size=300, max_position_embeddings=64, is_decoder=decoder).save_pretrained(d)
    argv = [a for a in RUN if a != "gpt-tiny"]
    argv.insert(argv.index("--model") + 1, str(d))
    if decoder:
        launched(argv, monkeypatch, capsys)
    else:
        refused(argv, monkeypatch, capsys, "its attention lets a position see later ones", "is_decoder")
