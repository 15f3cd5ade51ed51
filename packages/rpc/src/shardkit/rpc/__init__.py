"""shardkit.rpc: RPC distributed optimizer over RRefs and distributed autograd, exact under concurrency."""

from shardkit.rpc.__about__ import __version__
from shardkit.rpc._errors import RemoteOptimizerError
from shardkit.rpc._optimizer import DistributedOptimizer
from shardkit.rpc._scheduler import ParamGroupsView

__all__ = ["DistributedOptimizer", "ParamGroupsView", "RemoteOptimizerError", "__version__"]
