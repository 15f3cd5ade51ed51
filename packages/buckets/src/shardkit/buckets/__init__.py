"""shardkit.buckets: parameters as views of one flat buffer; DDP-style bucket planning.

* ``ParamBucket``: ``p.data`` of many params as views of one flat ``buffer`` (shardkit-optim
  broadcasts one per (device, dtype, owner)).
* ``plan_buckets``: deterministic, DDP-style assignment of params to size-capped buckets
  (shardkit-ddp lays out its flat buffers by it, shardkit-overlap predicts DDP's buckets).
"""

from shardkit.buckets.__about__ import __version__
from shardkit.buckets._param_bucket import ParamBucket
from shardkit.buckets._planning import BucketPlan, BucketSpec, plan_buckets

__all__ = [
    "BucketPlan",
    "BucketSpec",
    "ParamBucket",
    "__version__",
    "plan_buckets",
]
