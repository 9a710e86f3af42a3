"""Imported once by the forkserver the test worlds fork from (``_dist.PRELOAD``): the
modules every worker needs and one tiny ``torch.export``, whose first call in a process
costs ~2 s of one-time set-up, and the schedule simulator's two numba kernels (every
compile lowers and simulates a schedule; loading them from numba's disk cache costs
~0.5 s of CPU per process, compiling them on a fresh clone ~5 s). Forked workers
inherit all of it (~3-4 s each saved)."""
import torch
import torch._dynamo  # noqa: F401
import torch.fx.config
import torch._functorch.aot_autograd  # noqa: F401
import torch.export
import transformers.models.gpt2.modeling_gpt2  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
from ortools.sat.python import cp_model  # noqa: F401

import fxpipe.parallel  # noqa: F401
from fxpipe.schedules import generate, simulate
import tests.runtime._cases  # noqa: F401

# No source line per captured node: torch.export symbolizes a Python traceback for every
# node it records (~20% of a capture's CPU in a worker), kept only for error messages
# that name the user's line; the worlds check numbers and structures, never those lines
# (the messages are tested in one process: tests/passes, tests/models).
torch.fx.config.do_not_emit_stack_traces = True
torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()), (torch.randn(2, 4),),
                    strict=False)
simulate(generate("1f1b", 2, 2))  # compiles (or loads) both kernels of schedules/_sim_core.py
