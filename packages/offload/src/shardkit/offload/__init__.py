"""shardkit.offload: Sequential offload: run an nn.Sequential slice by slice from host memory."""

from shardkit.offload.__about__ import __version__

__all__ = ["__version__"]
