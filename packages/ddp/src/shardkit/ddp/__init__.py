"""shardkit.ddp: ShardedDataParallel (ZeRO-2): reduce-scatter grads into owners' shards, step, all-gather params."""

from shardkit.ddp.__about__ import __version__
from shardkit.ddp._config import ShardedDataParallelConfig
from shardkit.ddp._sharded_ddp import ShardedDataParallel
from shardkit.optim import (
    ELEMENTWISE_OPTIMIZERS,
    WIRE_FORMATS,
    BlockFormat,
    CommStats,
    is_elementwise,
)

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "WIRE_FORMATS",
    "BlockFormat",
    "CommStats",
    "ShardedDataParallel",
    "ShardedDataParallelConfig",
    "__version__",
    "is_elementwise",
]
