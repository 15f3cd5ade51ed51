"""shardkit.overlap: DDP comm hooks that run the sharded optimizer step per bucket, overlapped with backward."""

from shardkit.overlap.__about__ import __version__

__all__ = ["__version__"]
