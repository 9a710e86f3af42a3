"""Model functions for ``--model tests.job._bad_models:NAME`` in tests/job/test_bad_inputs.py."""
import torch
import torch.nn as nn

from fxpipe.models.gpt import GPT, GPTConfig

VOCAB_100 = GPTConfig(vocab_size=100, block_size=64, n_layer=2, n_head=4, n_embd=64)


def vocab100():
    """A GPT with a vocabulary of 100: byte data (ids up to 255) does not fit it."""
    torch.manual_seed(0)
    model = GPT(VOCAB_100)
    x = torch.randint(0, 100, (4, 17))
    return model, (x[:, :-1], x[:, 1:])


class _Branchy(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 8)

    def forward(self, x, y):
        h = self.emb(x)
        if h.sum() > 0:
            return h.mean()
        return -h.mean()


def data_dependent():
    x = torch.randint(0, 256, (2, 8))
    return _Branchy(), (x, x)


def not_a_tuple():
    return nn.Linear(2, 2)


def raises():
    """The user's own code fails: reported in one line as theirs."""
    return 1 // 0


def garbage_batch():
    return nn.Linear(2, 2), "not a tensor"
