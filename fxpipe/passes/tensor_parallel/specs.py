"""The shard contract lives in ``fxpipe/sharding.py`` (compiler and runtime both read it);
the pass's modules import it from here."""
from fxpipe.sharding import Ranges, ShardKind, ShardSpec, ranges_of, shard_state, shard_tensor, unshard_state

__all__ = ["Ranges", "ShardKind", "ShardSpec", "ranges_of", "shard_state", "shard_tensor", "unshard_state"]
