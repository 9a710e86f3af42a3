"""The compile context and hooks, defined in ``ir/compile_context.py`` (below the passes,
which take the context) and named here too, where the compile pipeline is."""
from fxpipe.ir.compile_context import CompileContext, CompileHooks, MeasureFn

__all__ = ["CompileContext", "CompileHooks", "MeasureFn"]
