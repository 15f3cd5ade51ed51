"""shardkit.buckets: flat buffers: params and grads as views of one contiguous tensor; bucket planning.

* ``ParamBucket``: ``p.data`` of many params as views of one flat ``buffer``.
* ``GradBucket``: ``p.grad`` of many params as views of one flat ``buffer`` (backward
  accumulates into it), with ``collapse``/``rebuild``, ``reattach`` and check-in state.
* ``plan_buckets``: deterministic, DDP-style assignment of params to size-capped buckets.
* ``build_param_buckets`` / ``build_grad_buckets``: buckets laid out as a plan says.
"""

from shardkit.buckets.__about__ import __version__
from shardkit.buckets._build import build_grad_buckets, build_param_buckets
from shardkit.buckets._grad_bucket import GradBucket
from shardkit.buckets._param_bucket import ParamBucket
from shardkit.buckets._planning import BucketPlan, BucketSpec, plan_buckets

__all__ = [
    "BucketPlan",
    "BucketSpec",
    "GradBucket",
    "ParamBucket",
    "__version__",
    "build_grad_buckets",
    "build_param_buckets",
    "plan_buckets",
]
