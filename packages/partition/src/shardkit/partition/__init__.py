"""shardkit.partition: Deterministic, balanced assignment of parameters (or flat fragments) to ranks."""

from shardkit.partition.__about__ import __version__

__all__ = ["__version__"]
