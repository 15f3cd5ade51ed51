"""shardkit.offload: run a model's layers slice by slice from host memory.

Public API:

- :class:`OffloadModel`: wraps an ``nn.Sequential`` (or pre-split slices).
- :func:`offload_blocks`: offloads a stack of repeated blocks inside any model.
- :class:`OffloadConfig`: the validated settings of either.
- :func:`balanced_slices`: the optimal contiguous partition used to split layers.
"""

from shardkit.offload.__about__ import __version__
from shardkit.offload._blocks import OffloadedBlocks, offload_blocks
from shardkit.offload._config import OffloadConfig
from shardkit.offload._model import OffloadModel
from shardkit.offload._planning import balanced_slices, module_bytes

__all__ = [
    "OffloadConfig",
    "OffloadModel",
    "OffloadedBlocks",
    "__version__",
    "balanced_slices",
    "module_bytes",
    "offload_blocks",
]
