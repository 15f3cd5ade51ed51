"""shardkit.optim: ZeRO-1 sharded optimizer wrapping any torch optimizer, with state consolidation and sharded checkpoints."""

from shardkit.optim.__about__ import __version__

__all__ = ["__version__"]
