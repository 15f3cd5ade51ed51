"""shardkit.partition: deterministic, balanced assignment of parameters to ranks.

Example:
    >>> import torch
    >>> from shardkit.partition import partition
    >>> params = [torch.empty(10, 10), torch.empty(50), torch.empty(30), torch.empty(20)]
    >>> p = partition(params, 2, algorithm="balanced")
    >>> p.params_of(0), p.params_of(1)
    ((0,), (1, 2, 3))
"""

from shardkit.partition.__about__ import __version__
from shardkit.partition._buckets import BucketPartition, shard_buckets
from shardkit.partition._consistency import check_consistent
from shardkit.partition._objects import all_gather_objects, comm_device
from shardkit.partition._partition import ALGORITHMS, Partition, partition
from shardkit.partition._shapes import ShapeFile, available_shapes, load_shapes
from shardkit.partition._spec import ParamSpec, param_costs

__all__ = [
    "ALGORITHMS",
    "BucketPartition",
    "ParamSpec",
    "Partition",
    "ShapeFile",
    "__version__",
    "all_gather_objects",
    "available_shapes",
    "check_consistent",
    "comm_device",
    "load_shapes",
    "param_costs",
    "partition",
    "shard_buckets",
]
