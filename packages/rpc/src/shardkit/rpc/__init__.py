"""shardkit.rpc: RPC distributed optimizer over RRefs and distributed autograd, exact under concurrency."""

from shardkit.rpc.__about__ import __version__

__all__ = ["__version__"]
