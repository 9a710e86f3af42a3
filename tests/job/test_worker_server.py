"""The server ``fxpipe run``'s local workers fork from (fxpipe/job/worker_server.py): its
warm-up compiles a pipeline and starts no thread (a fork keeps only the forking one), and
on a torch that can reach a GPU it does nothing (export would initialise the CUDA
runtime, which then fails in every forked worker). Its saving is measured, not
tested: a whole `fxpipe run`'s CPU seconds."""
from __future__ import annotations

import importlib
import os
import signal
import sys

import torch

import fxpipe.compiler.pipeline


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))  # native threads too, not only Python's


def _import_server(monkeypatch, gpu_build: bool) -> tuple[list, list]:
    """Import the module as the server does (its first import warms up); what it
    compiled and which CUDA queries it made. The signal handlers are put back."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: gpu_build)
    monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: False)
    asked: list[str] = []
    for name in ("is_available", "device_count", "init", "_lazy_init"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _name=name, **k: asked.append(_name) and False)
    compiled, real = [], fxpipe.compiler.pipeline.compile_pipeline

    def recorded(*args, **kwargs):
        compiled.append(real(*args, **kwargs))  # what it raises, the warm-up would swallow
        return compiled[-1]

    monkeypatch.setattr(fxpipe.compiler.pipeline, "compile_pipeline", recorded)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    sys.modules.pop("fxpipe.job.worker_server", None)
    try:
        importlib.import_module("fxpipe.job.worker_server")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == handlers[signal.SIGINT], "the workers inherit it"
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        sys.modules.pop("fxpipe.job.worker_server", None)
    return compiled, asked


def test_the_warm_up_compiles_a_pipeline_and_starts_no_thread(monkeypatch):
    threads = _threads()
    compiled, _ = _import_server(monkeypatch, gpu_build=False)
    assert len(compiled) == 1 and len(compiled[0].plan.stages) == 2
    assert _threads() == threads
    assert not torch.cuda.is_initialized()


def test_on_a_gpu_build_the_warm_up_leaves_cuda_alone(monkeypatch):
    compiled, asked = _import_server(monkeypatch, gpu_build=True)
    assert compiled == [] and asked == []
