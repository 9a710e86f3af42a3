"""A Llama (untied LM head) whose vocabulary projection outweighs half the model.

At pp=2 the split-matmul pass cuts the LM head into output-feature blocks, the
split-loss pass gives each block its share of the cross-entropy, and the partitioner
(cost model) places the first blocks on stage 0 and the rest on stage 1, where the
coalescing pass merges each stage's blocks into one: the untied head's weight gets
partial gradients on two ranks that the runtime must sum, and the running per-token
logsumexp crosses the stages instead of logits. Loaded by name,
``tests.runtime._wide_vocab:workload``, like any user model.
"""
from __future__ import annotations

import torch

from fxpipe.models.losses import causal_lm_loss
from fxpipe.models.hf import _llama

VOCAB, WIDTH, LAYERS, HEADS = 4096, 32, 2, 4


def workload(batch: int = 8, seq: int = 16):
    torch.manual_seed(0)
    model = _llama(layers=LAYERS, hidden=WIDTH, heads=HEADS, vocab=VOCAB, seq=seq)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone()), causal_lm_loss


def workload_tied(batch: int = 8, seq: int = 16, vocab: int = VOCAB):
    """The same shape as GPT-2 (LM head tied to the token embedding): the first stage
    reads the whole table, the head's rows are spread over the stages, and the
    gradient of the rows several ranks hold is summed range by range."""
    from fxpipe.models.hf import _gpt2

    torch.manual_seed(0)
    model = _gpt2(layers=LAYERS, hidden=WIDTH, heads=HEADS, vocab=vocab, seq=seq)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone()), causal_lm_loss


def workload_tied_odd(batch: int = 8, seq: int = 16):
    """Tied, with a vocabulary no tensor-parallel size divides (GPT-2's 50257 is odd):
    under TP the table is padded, and the last rank's block of the head ends in padding
    rows that must never win the softmax."""
    model, (ids, _), loss_fn = workload_tied(batch, seq, vocab=VOCAB - 3)
    ids[0, :4] = torch.arange(VOCAB - 7, VOCAB - 3)  # the last rows, next to the padding
    return model, (ids, ids.clone()), loss_fn
