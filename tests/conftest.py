import pytest
import torch

# Two cores: one intra-op thread per process keeps multi-process tests from thrashing.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
