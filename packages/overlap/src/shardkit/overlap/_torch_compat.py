"""The few private torch APIs this package relies on, isolated here and pinned by tests.

* ``GradBucket`` is re-exported by ``torch.distributed`` only at runtime (its stub lives in
  ``torch._C._distributed_c10d``); DDP compares a hook's ``bucket`` annotation with
  ``dist.GradBucket`` by identity, so the real class must be used, not a string.

The end-of-backward callback and the profiler flag this package relies on live in
shardkit-optim's ``_torch_compat`` (public: ``shardkit.optim.queue_end_of_backward`` and
``shardkit.optim.profiler_range``).
"""

from __future__ import annotations

from torch._C._distributed_c10d import GradBucket

__all__ = ["GradBucket"]
