"""The process ``fxpipe run``'s local workers fork from (multiprocessing's forkserver).

Spawned, each of N workers started a fresh interpreter and imported torch and fxpipe
(~5 s of CPU apiece); forked from a server that imported them once, a
worker starts with them loaded. This module is the server's first import, and only
the server's (``launcher.WORKER_SERVER_PRELOAD``): it sets a signal disposition and
warms the compiler up (``warm_up``).

The server ignores SIGTERM, as multiprocessing makes it ignore SIGINT. A signal sent
to the job's whole process group (Ctrl-C, ``kill -TERM -PGID``, a scheduler's stop)
reaches the workers, which save and stop after the same step, and the server, which
reports each worker's exit code to the launcher: dead, it would report every worker
gone at once and the launcher would return before their save. Each worker restores
SIGTERM's default as it starts (``launcher._spawned_entry``).
"""
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)


def warm_up() -> None:
    """Capture and compile a two-layer GPT once, here, so the workers fork with what a
    first ``torch.export`` and a first compile pay for (dynamo's and export's lazy
    imports and tables, the passes' first calls): ~2.5 s of CPU per worker, paid once
    instead of once per rank. It runs on the CPU and starts no thread (a fork keeps
    only the forking thread): pp 2 on a uniform partition and modelled costs, so it
    neither times the graph nor runs the ILP solver's threads, and tp 1 (the TP pass's
    shape refresh runs an fx Interpreter, whose progress bar starts tqdm's monitor
    thread). Only on a torch built for the CPU alone: export's fake tensors ask
    ``torch.cuda.is_available()`` at every op, which on a GPU build initialises the
    CUDA runtime, and a runtime initialised here fails in every forked worker.

    Only a saving: whatever it raises, the workers' own compile meets and reports. A
    Ctrl-C meanwhile is ignored, as multiprocessing ignores it once the preload is done
    (the handler put back is the one the workers inherit)."""
    import torch

    if torch.backends.cuda.is_built() or torch.xpu._is_compiled():
        return
    # Imported here, not above: this module's first statement sets the server's SIGTERM.
    from fxpipe.compiler.pipeline import compile_pipeline
    from fxpipe.ir.parallel_config import ParallelConfig
    from fxpipe.models import build_workload
    from fxpipe.partition import Method

    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        w = build_workload("gpt-tiny", batch=2, seq=8)
        compile_pipeline(w.model, w.example_inputs, ParallelConfig(pp=2, num_microbatches=2,
                                                                   partition=Method.UNIFORM, costs="model"),
                         loss_fn=w.loss_fn)
    except Exception:  # noqa: BLE001  (see the docstring)
        pass
    finally:
        signal.signal(signal.SIGINT, interrupt)


warm_up()
