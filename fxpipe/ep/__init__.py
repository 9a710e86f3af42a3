"""Expert parallelism: experts owned by the ranks of an expert group (the data-parallel
ranks), tokens exchanged with all-to-all.

- ``comm``: the differentiable all-to-all with uneven splits, and
  :func:`expert_group_context` (the group the graph's ops talk to, and the tokens per
  expert it counts);
- ``dispatch``: :func:`ep_dispatch` / :func:`ep_combine`, the graph ops the pass
  ``fxpipe.passes.expert_parallel`` puts around a grouped MoE's experts;
- ``grads``: gradient synchronisation of expert and dense parameters.
"""
from fxpipe.ep.comm import ExpertContext, all_to_all, current_expert_context, expert_group_context
from fxpipe.ep.dispatch import Route, ep_combine, ep_dispatch

__all__ = ["ExpertContext", "Route", "all_to_all", "current_expert_context", "ep_combine", "ep_dispatch",
           "expert_group_context"]
