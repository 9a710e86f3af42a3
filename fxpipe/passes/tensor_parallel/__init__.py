"""Automatic tensor parallelism (Megatron-LM, Shoeybi et al. 2019) as a compiler pass.

The entry is ``tensor_parallel_pass`` (``tp_pass.py``); docs/tensor_parallel.md explains
the method. Each step of the pass and the module that does it, in the order they run:

====  ==================  ==============================================================
step  module              what it does
====  ==================  ==============================================================
0     ``regions``         no-grad / autocast regions inlined so the rules see their ops
1     ``graph_ops``       what the pass knows of ATen ops; projections, token embeddings
                          and grad-carrying values found by structure -> ``GraphFacts``
2     ``provenance``      channel ids pushed through the graph, one rule per op
                          (``RULES``); ``provenance_ops`` holds the longer rules,
                          ``channel_ids`` the id arrays and the ``Provenance`` record
3     ``reading_search``  every reading of the optional rules planned, the smallest
                          per-rank share kept; per reading, steps 4-6 repeat, replicating
                          more channels, until every layout is expressible
4     ``assign``          channel classes given to ranks: heads, FFN channels, vocabulary
                          blocks (``gathered``: projections a norm reads whole, split with
                          their output all-gathered)
5     ``plan``            per node its local layout (``layout``), rewritten constants and
                          the conversions (f, scatter) its inputs need, one rule per op
                          (``RULES``; ``plan_ops`` holds the longer rules, ``plan_record``
                          the ``TPPlan`` and ``GraphFacts`` records); g sites
6     ``placement``       a ShardSpec per parameter, tied names agreeing
                          (``param_shards``: parameters split with their consumers)
7     ``coverage``        what stayed whole and each rank's share (``strict_tp`` refuses)
8     ``sequence``        with sp: sequence shards between blocks (Korthikanti et al. 2022)
9     ``rewrite``         the new graph, identical on every rank, with its collectives
                          (autocast regions closed again); ``shapes`` propagates its
                          values, nodes unchanged from the capture keeping theirs
====  ==================  ==============================================================

Op families with rules on both sides (provenance and plan) keep them in one module
each: ``mixers`` (state-space and short-convolution mixers), ``complex_views``
(rotary written with complex numbers), ``writes`` (``index_put`` at a mask),
``attention_forms`` (heads merged with the batch, shared key/value channels, constant
picks of fused QKV rows); ``norms`` decides which norms over split channels stay split.
"""
from fxpipe.ir.pass_configs import TPConfig
from fxpipe.ir.shard_spec import ShardKind, ShardSpec, shard_state, unshard_state
from fxpipe.ir.tp_result import (BlockInfo, BlockKind, CollectiveKind, CollectiveSite, Comm, TPResult,
                                 render_sharding_report)
from fxpipe.passes.tensor_parallel.tp_pass import tensor_parallel_pass

__all__ = ["BlockInfo", "BlockKind", "CollectiveKind", "CollectiveSite", "Comm", "ShardKind",
           "ShardSpec", "TPConfig", "TPResult", "render_sharding_report", "shard_state",
           "tensor_parallel_pass", "unshard_state"]
