"""shardkit.buckets: Flat buffers: params and grads as views of one contiguous tensor; bucket planning."""

from shardkit.buckets.__about__ import __version__

__all__ = ["__version__"]
