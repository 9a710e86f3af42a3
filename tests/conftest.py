import pytest
import torch

# Two cores: one intra-op thread per process keeps multi-process tests from thrashing.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _session_cache_dir(tmp_path_factory):
    """fxpipe's caches (measured cost profiles: fxpipe/costs; layout searches:
    planner/layout_cache.py) live in this session's temporary directory, never in the
    user's ~/.cache (pytest removes all but its last few session directories); spawned
    workers and subprocesses inherit the variable."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FXPIPE_CACHE_DIR", str(tmp_path_factory.mktemp("fxpipe-cache")))
        yield


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
