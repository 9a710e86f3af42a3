"""Compiler passes: plain functions ``name_pass(ir, ctx) -> ir``, each in the module of its
name (the IR a Program, or after ``split`` a PipelinePlan; ``ctx`` the ``CompileContext``
of ``ir/compile_context.py``). The list they run in, and the driver, are the compiler's:
``fxpipe/compiler/pass_list.py``."""
from fxpipe.passes.canonicalize import canonicalize_pass
from fxpipe.passes.lint import ProgramInvariantError, lint_program
from fxpipe.passes.cost import cost_pass, total_cost

__all__ = ["ProgramInvariantError", "canonicalize_pass", "cost_pass", "lint_program", "total_cost"]
