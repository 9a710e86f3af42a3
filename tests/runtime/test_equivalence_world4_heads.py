"""The world of 4, second half (test_equivalence.py says what is checked, and
test_equivalence_world4.py has the first half): the zoo models at tp=2 × pp=2, the
LM head's rows owned over the ranks and run as vocabulary passes (pp=4, dp=2 × pp=2,
tp=2 × pp=2), and expert parallelism (dp=4 with ep=2; dp=2 × pp=2 with ep=2)."""
import pytest

from tests.runtime._cases import train_cases
from tests.runtime._dist import run_world
from tests.runtime._equivalence import case_id, check, world4_cases, world4_part

CASES = [world4_cases()[i] for i in world4_part(1)]


@pytest.fixture(scope="module")
def world4():
    return run_world(4, train_cases, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_world4(world4, index):
    """Zoo models, vocabulary-parallel heads and expert parallelism on 4 processes."""
    check(world4, index)
