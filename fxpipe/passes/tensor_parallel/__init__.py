"""Automatic tensor parallelism (Megatron-LM, Shoeybi et al. 2019) as a compiler pass."""
from fxpipe.ir.pass_configs import TPConfig
from fxpipe.ir.shard_spec import ShardKind, ShardSpec, shard_state, unshard_state
from fxpipe.ir.tp_result import (BlockInfo, BlockKind, CollectiveKind, CollectiveSite, Comm, TPResult,
                                 render_sharding_report)
from fxpipe.passes.tensor_parallel.tp_pass import tensor_parallel_pass

__all__ = ["BlockInfo", "BlockKind", "CollectiveKind", "CollectiveSite", "Comm", "ShardKind",
           "ShardSpec", "TPConfig", "TPResult", "render_sharding_report", "shard_state",
           "tensor_parallel_pass", "unshard_state"]
