"""shardkit.optim: ZeRO-1 sharded optimizer wrapping any torch optimizer, with state consolidation and sharded checkpoints."""

from shardkit.optim.__about__ import __version__
from shardkit.optim._agreement import (
    agree_call,
    agree_outcome,
    agree_values,
    describe_difference,
    hyperparam_digest,
    hyperparams,
    register_call,
)
from shardkit.optim._checkpoint import load_consolidated, load_sharded, save_sharded
from shardkit.optim._compat import OSS, ZeroRedundancyOptimizer
from shardkit.optim._driver import ShardLayout, ShardOwner, StepDriver
from shardkit.optim._grad_scaler import ShardedGradScaler
from shardkit.optim._safe_reader import SafeFileSystemReader, UnsafeCheckpointError
from shardkit.optim._sharded_optimizer import ShardedOptimizer
from shardkit.optim._torch_compat import profiler_range, queue_end_of_backward

__all__ = [
    "OSS",
    "SafeFileSystemReader",
    "ShardLayout",
    "ShardOwner",
    "ShardedGradScaler",
    "ShardedOptimizer",
    "StepDriver",
    "UnsafeCheckpointError",
    "ZeroRedundancyOptimizer",
    "__version__",
    "agree_call",
    "agree_outcome",
    "agree_values",
    "describe_difference",
    "hyperparam_digest",
    "hyperparams",
    "load_consolidated",
    "load_sharded",
    "profiler_range",
    "queue_end_of_backward",
    "register_call",
    "save_sharded",
]
