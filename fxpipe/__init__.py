"""fxpipe: compile an unmodified PyTorch model for tensor- and pipeline-parallel training.

    import fxpipe
    pm = fxpipe.parallelize(model, tp=2, pp=2, microbatches=8, example_inputs=batch)
    loss = pm.train_step(batch)
"""
from typing import Any

from fxpipe.compiler.capture import CaptureError, capture
from fxpipe.ir.program import NodeCost, ParamInfo, ParamKind, Program, TensorSpec

__version__ = "0.1.0"
__all__ = ["CaptureError", "CompiledPipeline", "NodeCost", "ParallelConfig", "ParallelModel", "ParamInfo",
           "ParamKind", "Program", "TensorSpec", "capture", "compile_pipeline", "parallelize", "__version__"]

# The runtime (torch.distributed, the partition solver) loads on first use, so that
# `import fxpipe` and the CLI's --help stay quick (PEP 562 module __getattr__).
_LAZY = {"parallelize": "fxpipe.parallel", "ParallelModel": "fxpipe.runtime.api",
         "ParallelConfig": "fxpipe.ir.parallel_config", "compile_pipeline": "fxpipe.compiler.pipeline",
         "CompiledPipeline": "fxpipe.ir.artifact"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")
