"""The world of 4, second half (test_equivalence.py says what is checked, and
test_equivalence_world4.py has the first half): the zoo models at tp=2 × pp=2, the
LM head's rows owned over the ranks and run as vocabulary passes (pp=4, dp=2 × pp=2,
tp=2 × pp=2), and expert parallelism (dp=4 with ep=2; dp=2 × pp=2 with ep=2)."""
from tests.runtime._equivalence import world4_module

CASES, world4, test_world4 = world4_module(1)
