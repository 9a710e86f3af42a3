"""Compiler passes: plain functions ``name_pass(program, config) -> program``."""
from fxpipe.passes.canonicalize import canonicalize_pass
from fxpipe.passes.driver import DEFAULT_PASSES, PassSpec, PassTiming, pass_names, run_passes
from fxpipe.passes.lint import ProgramInvariantError, lint_program
from fxpipe.passes.node_cost import cost_pass, total_cost

__all__ = ["DEFAULT_PASSES", "PassSpec", "PassTiming", "ProgramInvariantError", "canonicalize_pass",
           "cost_pass", "lint_program", "pass_names", "run_passes",
           "total_cost"]
