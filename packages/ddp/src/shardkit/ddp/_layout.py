"""``ShardedDataParallel``'s buckets: shardkit-optim's flat buckets plus the reduction's state.

The layout itself (owner-contiguous flat buffers, who owns which element range, fragment and
whole-param buckets) is shardkit-optim's public :class:`~shardkit.optim.FlatBucket` ([Note:
Owner-contiguous buckets] in ``shardkit.optim._flat``), stepped by its
:class:`~shardkit.optim.ShardStepper`. This module adds what only the backward side needs: the
params still to stage in this backward, the staging buffer, the in-flight reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from shardkit.optim import FlatBucket

__all__: list[str] = []


@dataclass(eq=False)
class _Bucket(FlatBucket):
    """A :class:`~shardkit.optim.FlatBucket` with the state of its reduction."""

    pending: set[int] = field(default_factory=set)
    """Positions (in ``params``) whose gradient this backward has not staged yet."""
    used: set[int] = field(default_factory=set)
    """Positions of the params that staged a real gradient on this rank since the grad shard
    was last consumed (see [Note: Per-param fragments] in ``shardkit.optim._shard_stepper``)."""
    staging: torch.Tensor | None = None
    launched: bool = False
    work: object | None = None
    out: torch.Tensor | None = None
    """Where the in-flight reduce-scatter writes (``grad_shard`` or a temporary)."""
    add_out: bool = False
    """Whether the temporary ``out`` is added to ``grad_shard`` (else copied into it)."""

    def reset_backward(self) -> None:
        """Every param still to stage, nothing launched: the state at the start of a backward."""
        self.pending = set(range(len(self.params)))
        self.launched = False
