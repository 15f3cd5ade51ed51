"""The frozen configuration of one registered overlap."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OverlapConfig"]


@dataclass(frozen=True)
class OverlapConfig:
    """How the sharded optimizer step is scheduled against DDP's gradient buckets."""

    interleaved: bool = True
    """Step and broadcast each bucket once the reduction of the bucket two places later is
    launched (``True``, see [Note: Interleave lag]), or step every bucket once the last
    bucket's reduction is launched (``False``)."""

    shard_buckets: bool = False
    """Split each DDP bucket across ranks at parameter boundaries (``True``) or give whole
    buckets to ranks (``False``). See [Note: Bucket-aligned ownership]."""
