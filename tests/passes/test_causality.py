"""passes/causality.py: whether a captured model's attention lets a position see later ones."""
import torch

import fxpipe
from fxpipe.models import build_workload


def test_causality_is_read_off_the_attention_mask():
    """is_causal=True, a lower-triangular mask built from positions, or a mask that lets
    position 0 see position 7 (a bidirectional encoder): judged on the graph alone."""
    import transformers

    from fxpipe.models.losses import next_token_loss
    from fxpipe.passes.causality import attention_is_causal

    def judged(model):
        ids = torch.randint(0, 100, (2, 8))
        return attention_is_causal(fxpipe.capture(model, (ids, ids), next_token_loss))

    small = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    assert judged(transformers.BertLMHeadModel(transformers.BertConfig(**small))) is False
    assert judged(transformers.BertLMHeadModel(transformers.BertConfig(is_decoder=True, **small))) is True
    assert judged(transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **small))) is True
    w = build_workload("gpt-tiny", batch=2, seq=8)
    assert attention_is_causal(fxpipe.capture(w.model, w.example_inputs, w.loss_fn)) is True
