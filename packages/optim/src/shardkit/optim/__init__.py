"""shardkit.optim: ZeRO-1 sharded optimizer wrapping any torch optimizer, with state consolidation and sharded checkpoints."""

from shardkit.optim.__about__ import __version__
from shardkit.optim._checkpoint import load_consolidated, load_sharded, save_sharded
from shardkit.optim._compat import OSS, ZeroRedundancyOptimizer
from shardkit.optim._grad_scaler import ShardedGradScaler
from shardkit.optim._sharded_optimizer import ShardedOptimizer

__all__ = [
    "OSS",
    "ShardedGradScaler",
    "ShardedOptimizer",
    "ZeroRedundancyOptimizer",
    "__version__",
    "load_consolidated",
    "load_sharded",
    "save_sharded",
]
