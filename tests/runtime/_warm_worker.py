"""Imported once by the forkserver the test worlds fork from (``_dist.PRELOAD``): the
modules every worker needs and one tiny ``torch.export``, whose first call in a process
costs ~2 s of one-time set-up, and the schedule simulator's two numba kernels (every
compile lowers and simulates a schedule; loading them from numba's disk cache costs
~0.5 s of CPU per process, compiling them on a fresh clone ~5 s). Forked workers
inherit all of it (~3-4 s each saved).

It also captures the models the equivalence worlds train, at the microbatches their
layouts capture (``PRECAPTURED``): ~1-2 s of CPU each (~4 s for the MoE), made once here
instead of once per rank in every world that trains them (4-12 ranks each over the worlds
of 2, 4 and 8 of test_equivalence*.py, and test_compiled.py's gpt-tiny at 4 layers). Under
pytest-xdist each worker's server makes them once: each model here is captured by more ranks."""
import torch
import torch._dynamo  # noqa: F401
import torch._functorch.aot_autograd  # noqa: F401
import torch.export
import transformers.models.gpt2.modeling_gpt2  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
from ortools.sat.python import cp_model  # noqa: F401

import fxpipe.parallel  # noqa: F401
from fxpipe.schedules import generate, simulate
import tests.runtime._cases  # noqa: F401
from tests.runtime import _equivalence as _eq
from tests.runtime._reuse_capture import precapture

torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()), (torch.randn(2, 4),),
                    strict=False)
simulate(generate("1f1b", 2, 2))  # compiles (or loads) both kernels of schedules/_sim_core.py

# (model, rows of its microbatch): _cases' batch of 8 rows over 4 microbatches and dp replicas
# (world / (tp·pp)): 2 rows at dp=1, 1 at dp=2. A key no case asks for only costs its capture.
PRECAPTURE = [("gpt-tiny", 2), ("gpt-tiny", 1), ("hf:gpt2", 2), ("hf:llama", 2), ("hf:llama", 1),
              (_eq.WIDE, 2), (_eq.WIDE, 1), (_eq.TIED, 2), (_eq.TIED, 1), (_eq.TIED_ODD, 2),
              *((m, 2) for m in _eq.ZOO_MODELS)]
for name, rows in PRECAPTURE:
    w = tests.runtime._cases.workload(name)
    precapture(w.model, tuple(t[:rows] for t in w.example_inputs), w.loss_fn)
