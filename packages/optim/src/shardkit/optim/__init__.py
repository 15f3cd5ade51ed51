"""shardkit.optim: ZeRO-1 sharded optimizer wrapping any torch optimizer, with state consolidation and sharded checkpoints.

It also owns the sharding engine the other distributions drive (``docs/engine.md``): the
ZeRO-1 partition (:class:`ShardLayout`) and driver contract (:class:`StepDriver`,
:class:`ShardOwner`), and ZeRO-2's owner-contiguous flat buckets (:class:`FlatBucket`), the
local step of a rank's shards (:class:`ShardStepper`) and their state dicts, and the ZeRO-2
engine a module adapter drives (:class:`Zero2Engine`, :class:`EngineOptions`,
:class:`CommStats`): one owner per bucket group, from the grad hook to the next forward.

Sharded checkpoints (:func:`save_sharded`, :func:`load_sharded`, :func:`load_consolidated`)
ride on shardkit-checkpoint; :class:`SafeFileSystemReader` and :class:`UnsafeCheckpointError`
are shardkit.checkpoint's, re-exported here for the code written against shardkit-optim 0.3.
"""

from shardkit.checkpoint import SafeFileSystemReader, UnsafeCheckpointError
from shardkit.optim.__about__ import __version__
from shardkit.optim._agreement import (
    agree_call,
    agree_outcome,
    agree_values,
    describe_difference,
    hyperparam_digest,
    hyperparams,
    register_call,
    register_error_type,
)
from shardkit.optim._aliases import OSS, ZeroRedundancyOptimizer
from shardkit.optim._checkpoint import (
    ShardedCheckpointable,
    load_consolidated,
    load_sharded,
    save_sharded,
)
from shardkit.optim._clip import (
    BLOCK,
    GradNorm,
    agree_grad_norm,
    block_norms,
    check_clip_args,
    grad_norm_partial,
)
from shardkit.optim._codecs import WIRE_FORMATS, BlockFormat
from shardkit.optim._dist import AllGather, global_rank
from shardkit.optim._driver import ShardLayout, ShardOwner, StepDriver
from shardkit.optim._engine import Zero2Engine
from shardkit.optim._flat import (
    ELEMENTWISE_OPTIMIZERS,
    FlatBucket,
    build_flat_buckets,
    is_elementwise,
)
from shardkit.optim._grad_scaler import ShardedGradScaler
from shardkit.optim._master_set import GradFactors
from shardkit.optim._options import EngineOptions
from shardkit.optim._profiling import profiler_range, profiling
from shardkit.optim._relink import ParamStorageError
from shardkit.optim._shard_state import (
    ParkedState,
    checkpoint_part,
    gather_full_state_dict,
    load_full_state_dict,
)
from shardkit.optim._shard_stepper import ShardEntry, ShardStepper
from shardkit.optim._sharded_optimizer import ShardedOptimizer
from shardkit.optim._state import global_index, global_params
from shardkit.optim._torch_compat import (
    all_gather_single,
    queue_end_of_backward,
    reduce_scatter_single,
)
from shardkit.optim._wire import CommStats

__all__ = [
    "BLOCK",
    "ELEMENTWISE_OPTIMIZERS",
    "OSS",
    "WIRE_FORMATS",
    "AllGather",
    "BlockFormat",
    "CommStats",
    "EngineOptions",
    "FlatBucket",
    "GradFactors",
    "GradNorm",
    "ParamStorageError",
    "ParkedState",
    "SafeFileSystemReader",
    "ShardEntry",
    "ShardLayout",
    "ShardOwner",
    "ShardStepper",
    "ShardedCheckpointable",
    "ShardedGradScaler",
    "ShardedOptimizer",
    "StepDriver",
    "UnsafeCheckpointError",
    "Zero2Engine",
    "ZeroRedundancyOptimizer",
    "__version__",
    "agree_call",
    "agree_grad_norm",
    "agree_outcome",
    "agree_values",
    "all_gather_single",
    "block_norms",
    "build_flat_buckets",
    "check_clip_args",
    "checkpoint_part",
    "describe_difference",
    "gather_full_state_dict",
    "global_index",
    "global_params",
    "global_rank",
    "grad_norm_partial",
    "hyperparam_digest",
    "hyperparams",
    "is_elementwise",
    "load_consolidated",
    "load_full_state_dict",
    "load_sharded",
    "profiler_range",
    "profiling",
    "queue_end_of_backward",
    "reduce_scatter_single",
    "register_call",
    "register_error_type",
    "save_sharded",
]
