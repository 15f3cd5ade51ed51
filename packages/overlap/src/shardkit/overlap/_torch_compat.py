"""The few private torch APIs this package relies on, isolated here and pinned by tests.

* ``GradBucket`` is re-exported by ``torch.distributed`` only at runtime (its stub lives in
  ``torch._C._distributed_c10d``); DDP compares a hook's ``bucket`` annotation with
  ``dist.GradBucket`` by identity, so the real class must be used, not a string.
* ``torch.autograd.Variable._execution_engine.queue_callback``: runs a function at the end of
  the current backward pass, after the callbacks queued before it (DDP queues its
  ``finalize_backward`` there). FSDP relies on it too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C._distributed_c10d import GradBucket

__all__ = ["GradBucket"]


def _queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs ``fn`` once the running backward pass finishes, after earlier queued callbacks.

    Must be called from inside a backward pass (an autograd hook or a DDP comm hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)
