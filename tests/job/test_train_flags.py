"""`fxpipe run`: bad flags fail before any process starts (a job that trains and reports:
tests/job/test_train_your_model.py)."""
import pytest

from fxpipe.cli import main
from fxpipe.data import DataStream, PackedWindows, stdlib_stream


def test_builtin_batches_are_a_function_of_seed_and_position():
    windows = PackedWindows(stdlib_stream(1 << 20), seq=16)
    a, b = DataStream(windows, 3, seed=1), DataStream(windows, 3, seed=1)
    assert all((a.next_batch() == b.next_batch()).all() for _ in range(3))
    assert not (DataStream(windows, 3, seed=2).next_batch() == a.next_batch()).all()


@pytest.mark.parametrize("argv,message", [
    # A layout flag without --world: the layout as given (4·4·1 rows), which 10 is not.
    (["--global-batch", "10", "--pp", "2"], "global batch 10"),
    (["--schedule", "nope"], "valid names are: gpipe, 1f1b"),
    (["--model", "nope"], "unknown model"),
    (["--eval-interval", "5", "--val-fraction", "0"], "--eval-interval needs validation data"),
    (["--seq", "100000"], "exceeds gpt-small's block size"),
])
def test_bad_flags_fail_fast(capsys, argv, message):
    assert main(["run", *argv]) == 2
    assert message in capsys.readouterr().err
