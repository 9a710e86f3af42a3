import os
import tempfile

import pytest
import torch

# Measured cost profiles (fxpipe/costs) are cached per test session, never in the
# user's ~/.cache; spawned workers inherit the variable.
os.environ["FXPIPE_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxpipe-test-cache-")

# Two cores: one intra-op thread per process keeps multi-process tests from thrashing.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
