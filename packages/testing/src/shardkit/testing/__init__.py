"""shardkit.testing: run pytest test bodies on N ranks over Gloo or NCCL.

Example:
    >>> import torch, torch.distributed as dist
    >>> from shardkit.testing import world
    >>> @world(2)
    ... def test_allreduce():
    ...     t = torch.ones(1) * dist.get_rank()
    ...     dist.all_reduce(t)
    ...     assert t.item() == 1.0
"""

from shardkit.testing.__about__ import __version__
from shardkit.testing._allocations import Allocation, LargeAllocations
from shardkit.testing._config import DEFAULT_TIMEOUT_S, MAX_WORLD_SIZE, WorldSpec
from shardkit.testing._decorator import free_port, world
from shardkit.testing._devices import rank_cuda_device
from shardkit.testing._logs import LogCapture, captured_logs
from shardkit.testing._memory import live_storages
from shardkit.testing._resident import MemorySample, memory_sample, reset_peak_memory
from shardkit.testing._world import WorldStartError, pool

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_WORLD_SIZE",
    "Allocation",
    "LargeAllocations",
    "LogCapture",
    "MemorySample",
    "WorldSpec",
    "WorldStartError",
    "__version__",
    "captured_logs",
    "free_port",
    "live_storages",
    "memory_sample",
    "pool",
    "rank_cuda_device",
    "reset_peak_memory",
    "world",
]
