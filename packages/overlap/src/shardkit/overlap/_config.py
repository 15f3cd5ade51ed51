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

    reduce_to_owner: bool = False
    """Reduce each bucket's gradients only to the ranks that own them (one ``dist.reduce`` per
    (bucket, owner) run of params, pre-divided by the world size like ``allreduce_hook``)
    instead of all-reducing them, then broadcast the updated params as usual: about 2x the
    bucket bytes on the wire instead of 3x. Only with the default ``allreduce_hook`` and with
    the step in the hooks (no grad scaler / clipping). After backward, ``.grad`` holds the
    averaged gradient for the params this rank owns and zeros for the others. See
    [Note: Reduce to owner]."""
