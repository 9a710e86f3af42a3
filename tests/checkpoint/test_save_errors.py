"""A save that fails names why: a full disk is ENOSPC with the bytes the save needed."""
from __future__ import annotations




def test_a_full_disk_during_a_save_is_named_enospc_with_the_bytes(tmp_path):
    import errno

    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from fxpipe.checkpoint.dcp import save_error

    state = {"model": {"w": torch.zeros(1024, 256)}, "optim": {"m": [torch.zeros(10)]}}  # 1 MiB + 40 B
    full = OSError(errno.ENOSPC, "No space left on device")
    exc = CheckpointException("save failed", {0: (full, None), 1: (RuntimeError("peer gone"), None)})
    err = save_error(exc, tmp_path / "step_00000010", tmp_path / ".tmp", state)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert "no space left on device (ENOSPC)" in str(err) and "writes about 1048616 bytes" in str(err)
    other = save_error(CheckpointException("x", {1: (RuntimeError("boom\nmore"), None)}), tmp_path / "s", tmp_path, {})
    assert isinstance(other, RuntimeError) and "rank 1: RuntimeError: boom more" in str(other)
    assert "\n" not in str(other)
