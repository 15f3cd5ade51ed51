"""shardkit.testing: pytest plugin: run a test body on N ranks (Gloo/NCCL) with timeouts, per-rank stacks and reused worlds."""

from shardkit.testing.__about__ import __version__

__all__ = ["__version__"]
