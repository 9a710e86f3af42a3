"""``base/current.py``: a value current for a block, as the TP and EP groups are kept."""
import threading

import pytest

from fxpipe.base.current import CurrentValue


def test_a_block_sets_the_value_and_puts_back_the_one_before_even_on_error():
    current = CurrentValue("test_value", "read outside a block: wrap it")
    assert current.get_or_none() is None
    with pytest.raises(RuntimeError, match="read outside a block: wrap it"):
        current.get()
    with current.scope("outer") as got:
        assert got == "outer" and current.get() == "outer"
        with pytest.raises(KeyError):
            with current.scope("inner"):
                assert current.get() == "inner"
                raise KeyError("inside")
        assert current.get() == "outer"
    assert current.get_or_none() is None


def test_each_thread_sees_only_what_it_set():
    current = CurrentValue("test_value", "outside")
    seen = {}

    def rank(r):
        with current.scope(r):
            barrier.wait()  # both ranks are inside their blocks at once
            seen[r] = current.get()

    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {0: 0, 1: 1}
