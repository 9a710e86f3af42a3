"""fxpipe: compile an unmodified PyTorch model for tensor- and pipeline-parallel training."""
from fxpipe.capture import CaptureError, capture
from fxpipe.program import NodeCost, ParamInfo, ParamKind, Program, TensorSpec

__version__ = "0.1.0"
__all__ = ["CaptureError", "NodeCost", "ParamInfo", "ParamKind", "Program", "TensorSpec",
           "capture", "__version__"]
