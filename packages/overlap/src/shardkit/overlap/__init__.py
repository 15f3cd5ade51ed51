"""shardkit.overlap: DDP comm hooks that run the sharded optimizer step per bucket, overlapped with backward."""

from shardkit.overlap.__about__ import __version__
from shardkit.overlap._api import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    register_zero_overlap,
)
from shardkit.overlap._config import OverlapConfig
from shardkit.overlap._overlap import CommHook, ZeroOverlap

__all__ = [
    "CommHook",
    "OverlapConfig",
    "ZeroOverlap",
    "__version__",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "register_zero_overlap",
]
