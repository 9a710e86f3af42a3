"""A one-process gloo world that drives the checkpoint directory protocol with a plain
state dict (no model: cheap to start), for the fault tests. Usage:

    python -m tests.checkpoint._ckpt_child hold DIR          save step 1, print HELD, sleep
    python -m tests.checkpoint._ckpt_child save DIR STEP...  save those steps, print OK / the error
    python -m tests.checkpoint._ckpt_child loop DIR          save steps n+1, n+2, ... (keep_last=2) forever
    python -m tests.checkpoint._ckpt_child choose DIR latest|STEP...
                                                          what a resume (of the newest / of STEP) picks:
                                                          CHOSE <dir> / WARN <category>: ... / ERROR ...
"""
from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

META = dict(extra={}, world_size=1, mesh=dict(pp=1, dp=1, tp=1), source="Toy", precision="fp32",
            loss_scaler=None, state_dict={"w": "w", "b": "b"}, torch=torch.__version__)


def state(step: int) -> dict[str, torch.Tensor]:
    """Values that identify the step; about 2 MB, so that a save takes some milliseconds."""
    g = torch.Generator().manual_seed(step)
    return {"model.w": torch.randn(512, 512, generator=g), "model.b": torch.full((512,), float(step)),
            "optim.state.w.exp_avg": torch.randn(512, 512, generator=g)}


def main(mode: str, directory: str, *steps: str) -> None:
    # The rendezvous file beside the test's directory (inside its tmp_path, never /tmp);
    # the group destroyed before exit: gloo's threads alive at interpreter exit abort the
    # process ("terminate called without an active exception", SIGABRT).
    # After its work the child leaves without the interpreter's finalization, as multiprocessing's
    # children do: a gloo worker thread still releasing a finished collective's tensors
    # needs the GIL, and during finalization Python ends such a thread, which aborts the
    # process the same way (seen once in CI, in a `choose` child, after the decision
    # group's threads were already joined: runtime/launch.py). The exit code and every
    # line printed are the child's own.
    store = Path(directory).absolute().parent / f".gloo-store-{os.getpid()}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    code = 1
    try:
        run(mode, directory, *steps)
        code = 0
    except BaseException:  # noqa: BLE001  (printed as an uncaught one would be, then exit 1)
        traceback.print_exc()
    finally:
        dist.destroy_process_group()
        store.unlink(missing_ok=True)
    gc.collect()  # a cycle still holding a group lets its threads go before we leave
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(mode: str, directory: str, *steps: str) -> None:
    from fxpipe.checkpoint.dcp import write_checkpoint

    if mode == "hold":
        write_checkpoint(state(1), directory, 1, dict(META, step=1), keep_last=None)
        print("HELD", flush=True)
        time.sleep(600)
    elif mode == "save":
        try:
            for s in map(int, steps):
                write_checkpoint(state(s), directory, s, dict(META, step=s), keep_last=None)
            print("OK", flush=True)
        except Exception as exc:
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
    elif mode == "choose":  # the collective choice load_checkpoint makes, warnings included
        import warnings

        from fxpipe.checkpoint.dcp import choose_intact
        for which in steps:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    path, _ = choose_intact(directory, None if which == "latest" else int(which))
                    print(f"CHOSE {path.name}", flush=True)
                except Exception as exc:
                    print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
            for w in caught:
                print(f"WARN {w.category.__name__}: {w.message}", flush=True)
    elif mode == "loop":  # continues after the newest checkpoint, as a resumed job would
        from fxpipe.checkpoint.files import adopt_run, list_checkpoints, run_of
        found = list_checkpoints(directory)
        step = found[-1][0] + 1 if found else 1
        if found:  # continues the run that saved them (a resume adopts it), so its prune applies
            adopt_run(directory, run_of(found[-1][1]))
        while True:
            write_checkpoint(state(step), directory, step, dict(META, step=step), keep_last=2)
            print(f"SAVED {step}", flush=True)
            step += 1


if __name__ == "__main__":
    main(*sys.argv[1:])
