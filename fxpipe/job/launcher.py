"""Starting ``fxpipe run``'s workers and stopping them cleanly.

Without torchrun's environment, ``launch`` starts tp·pp·dp local worker processes
through torch.distributed's elastic launcher — the code path torchrun uses, so
``torchrun --nproc-per-node N -m fxpipe run ...`` (and multi-node rendezvous) run
the same worker function (``fxpipe.job.train.worker``). A failed worker is reported as
one line naming its rank and error; SIGTERM / Ctrl-C stop every rank after the same
step (``StopSignal``). The workers fork from one server process that imported torch and
fxpipe once (``worker_server.py``), not N processes each importing them again.
"""
from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import signal
import sys
import uuid
from typing import Any

import torch.distributed as dist

from fxpipe.job.config import TrainConfig
from fxpipe.job.stop_signal import StopSignal
from fxpipe.job.train import worker
from fxpipe.runtime.launch import launched_rank, under_torchrun


WORKER_SERVER_PRELOAD = ("fxpipe.job.worker_server", "fxpipe.cli", "fxpipe.job.launcher")
"""What the server the workers fork from imports (``worker_server.py`` first, then the
main module a worker re-runs, ``python -m fxpipe`` or the ``fxpipe`` script, both
importing fxpipe.cli, and the workers' entry)."""


def _elastic_entry(config: TrainConfig) -> dict[str, Any]:

    stop = StopSignal()  # kept until the end: a forwarded signal must not cut a save short
    try:
        return worker(config, stop)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:  # the error report would need disk space too: say it here
            print(f"fxpipe run: rank {launched_rank()}: ENOSPC: {exc.strerror}: {exc.filename}",
                  file=sys.stderr, flush=True)
        raise
    finally:
        stop.restore()
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned_entry(config: TrainConfig) -> dict[str, Any]:
    """A worker under the elastic launcher. Stopped by a signal, it exits at once with
    128 + signal: returning would block it until the agent reads its return value, which
    an agent that was signalled itself never does (it waits 30 s, then SIGKILLs)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server it forked from ignores it
    summary = _elastic_entry(config)
    if "signal" in summary:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + summary["signal"])
    return summary


def launch(config: TrainConfig, *, debug: bool = False) -> int:
    """Run the job: directly under torchrun, else spawn tp·pp·dp local workers.
    A failed worker is reported as one line naming its rank and error (``debug``:
    also torch's own report with every failed rank's traceback)."""
    # A run stopped by a signal exits 128 + its number (130 Ctrl-C, 143 SIGTERM), as a
    # shell reports a signalled process, after saving when --checkpoint-dir is set.
    if under_torchrun():
        summary = _elastic_entry(config)
        return 128 + summary["signal"] if "signal" in summary else 0
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Read when this process first starts a forkserver (a process that started one
    # already, with its own preload, keeps it: its workers import the rest on start).
    multiprocessing.set_forkserver_preload(list(WORKER_SERVER_PRELOAD))
    _cheap_rendezvous_event_names()
    launch_cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=config.world_size,
                              run_id=f"fxpipe-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                              start_method="forkserver")
    try:
        with _quiet_launcher_logs(not debug):
            elastic_launch(launch_cfg, _spawned_entry)(config)
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        if len(codes) == 1 and codes <= {128 + signal.SIGINT, 128 + signal.SIGTERM}:
            return codes.pop()  # only the workers were signalled; they stopped cleanly
        print(f"fxpipe run: {summarize_failure(exc)}", file=sys.stderr)
        if debug:
            print(exc, file=sys.stderr)
        return 1
    except SignalException as exc:  # the agent got it; its workers saved before it returned
        return 128 + int(exc.sigval)
    return 0


def _cheap_rendezvous_event_names() -> None:
    """The elastic rendezvous names each event it records after the method recording it,
    read off ``inspect.stack()`` twice per event (``dynamic_rendezvous.get_method_name``):
    that reads every frame's source and searches ``sys.modules`` for each frame's module,
    ~2.5 s of the launcher's CPU per ``fxpipe run`` with torch and fxpipe imported. The
    same name, read off the frame itself."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # fewer frames than that: torch's own answer
            return "no_method_name"

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = get_method_name


_NO_REPORT = "To enable traceback see"


def summarize_failure(exc: Any) -> str:
    """One line from the elastic launcher's ``ChildFailedError``: the first rank to fail
    (by the timestamp of its error file) and its exception, then the other ranks."""
    rank, failure = exc.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # the error file that ``record`` writes
        message = message.get("message", "")
    message = " ".join(str(message).split()) or f"exit code {failure.exitcode}"
    if message.startswith(_NO_REPORT):  # torch's text when the worker wrote no error file
        message = (f"exit code {failure.exitcode}, and no error report (one that cannot be written, e.g. on "
                   f"a full disk (ENOSPC), is printed by the rank above)")
    others = sorted(r for r in exc.failures if r != rank)
    also = f" (ranks {', '.join(map(str, others))} failed too)" if others else ""
    return (f"rank {rank} failed: {message}{also}; "
            f"add --debug for every failed rank's traceback")


@contextlib.contextmanager
def _quiet_launcher_logs(quiet: bool):
    """The elastic agent logs each failed worker's whole traceback and every SIGTERM it
    sends to the others; the launcher prints its own one-line summary instead."""
    import logging

    names = [n for n in list(logging.root.manager.loggerDict)
             if n.startswith(("torch.distributed.elastic", "torch.multiprocessing"))] if quiet else []
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
