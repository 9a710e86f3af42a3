"""A model function for `fxpipe run --model tests.runtime._faulty:build` that fails on rank 1."""
import os

from fxpipe.models import build_workload


def build():
    if os.environ.get("RANK") == "1":
        raise RuntimeError("injected failure on rank 1")
    w = build_workload("gpt-tiny", batch=4, seq=16)
    return w.model, w.example_inputs
