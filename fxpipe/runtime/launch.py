"""Process-group set-up at the edge: torchrun's environment is read here only."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxpipe.base.cpu_memory import keep_freed_blocks


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when GPUs are present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout: timedelta, device: torch.device | None = None) -> torch.device:
    """Initialise the default process group from torchrun's environment if needed.

    NCCL with GPUs, gloo on CPU. A single process without torchrun's variables
    becomes a world of one, so tp=pp=dp=1 runs without a launcher."""
    if device is None and dist.is_initialized() and torch.cuda.is_available():
        # The caller made the process group: CUDA tensors need a backend for them.
        # gloo lists CUDA ("cpu:gloo,cuda:gloo") but cannot send CUDA tensors point to point.
        pairs = dict(p.split(":", 1) for p in dist.get_backend_config().split(",") if ":" in p)
        if pairs.get("cuda", dist.get_backend()) == "gloo":
            device = torch.device("cpu")  # a gloo-only group: train on CPU, as the caller chose
    device = device or default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        keep_freed_blocks()  # a step's large temporaries reused, not re-faulted (base/cpu_memory.py)
    if dist.is_initialized():
        return device
    local = local_world_size()
    if device.type == "cuda" and local > torch.cuda.device_count():
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") after a long start.
        raise ValueError(f"{local} processes on this node but {torch.cuda.device_count()} GPU(s): one "
                         f"process per GPU; launch --nproc-per-node {torch.cuda.device_count()} (or hide the "
                         f"GPUs with CUDA_VISIBLE_DEVICES= to train on CPU with gloo)")
    # On GPUs both backends: NCCL for CUDA tensors, gloo for the CPU tensors of small
    # control collectives (the mean loss, the stop signal, object broadcasts); one
    # backend per device type, and every new_group inherits the pair.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group(backend, rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return device


def rank0_decides(decide: Callable[[], Any], *, timeout: timedelta = timedelta(hours=2),
                  as_raised: tuple[type[BaseException], ...] = ()) -> Any:
    """``decide()`` on global rank 0, its result broadcast to every rank — and so is its
    refusal: when rank 0 raises, every other rank raises the same message (a
    ``ValueError``/``TypeError`` as rank 0's is, else ``RuntimeError``) instead of dying
    in the next collective with gloo's "Connection closed by peer"; an exception of a type
    in ``as_raised`` reaches them as itself (a checkpoint's lock held, a full disk). Rank 0
    re-raises its own exception. The others wait on a group of their own, with
    ``timeout``, because a decision (the layout search, the partition solve) may outlast
    the collectives' timeout. Without a process group, simply ``decide()``.

    Other ranks' work that rank 0's decision needs (the far end of a measured link) is
    done before the call; ``decide`` on rank 0 returns what is to be shared."""
    if not dist.is_initialized():
        return decide()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box = [(True, decide())]
        except Exception as exc:  # noqa: BLE001  (every rank must hear it, whatever it is)
            failure = exc
            box = [(False, _heard(exc, as_raised))]
    _broadcast_on_own_group(box, timeout)
    ok, value = box[0]
    if failure is not None:
        raise failure
    if not ok:
        if isinstance(value, BaseException):
            raise value
        kind, message = value
        raise {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)(message)
    return value


def _broadcast_on_own_group(box: list[Any], timeout: timedelta) -> None:
    """``box`` broadcast from rank 0 on a new gloo group that is gone when this returns.

    ``destroy_process_group`` only unregisters a group: its gloo threads (two workers
    and a transport loop) stop when the last reference to it goes. A refusal's
    traceback held the caller's frame, the group in it, in a reference cycle, so the
    threads ran on into the interpreter's finalization. There they can abort the
    process ("terminate called without an active exception": a worker that needs the
    GIL then, to release a broadcast's tensors, is ended by Python), as a saving child
    refused by the lock did about one run in 30 on a loaded machine. The group
    lives in this frame only and is released here, on every path: its destructor
    joins the threads before the caller goes on."""
    group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
        del group  # the last reference: the group's threads are joined here


def _heard(exc: Exception, as_raised: tuple[type[BaseException], ...]) -> Any:
    """What the other ranks receive of rank 0's exception: itself when its type is one
    to pass on as raised, else (kind, message)."""
    if isinstance(exc, as_raised):
        return exc
    kind = "TypeError" if isinstance(exc, TypeError) else "ValueError" if isinstance(exc, ValueError) \
        else "RuntimeError"
    return kind, f"{exc}" if kind != "RuntimeError" else f"rank 0 failed: {type(exc).__name__}: {exc}"


def under_torchrun() -> bool:
    """Whether torchrun (or a launcher setting its variables) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world() -> int | None:
    """The ranks torchrun started (WORLD_SIZE), or None outside torchrun."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else None


def launched_rank() -> str:
    """This process's global rank as torchrun named it, "?" outside torchrun (for messages)."""
    return os.environ.get("RANK", "?")


def local_world_size(default: int = 1) -> int:
    """Ranks started on this machine (torchrun's LOCAL_WORLD_SIZE), else ``default``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def threads_per_rank() -> int:
    """A CPU rank's share of this machine's cores: the cores over the ranks started here."""
    return max(1, (os.cpu_count() or 1) // local_world_size())
