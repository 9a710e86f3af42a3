"""Compiler passes: plain functions ``name_pass(program, config) -> program`` (the list
they run in, and the driver, are the compiler's: ``fxpipe/compiler/pass_list.py``)."""
from fxpipe.passes.canonicalize import canonicalize_pass
from fxpipe.passes.lint import ProgramInvariantError, lint_program
from fxpipe.passes.node_cost import cost_pass, total_cost

__all__ = ["ProgramInvariantError", "canonicalize_pass", "cost_pass", "lint_program", "total_cost"]
