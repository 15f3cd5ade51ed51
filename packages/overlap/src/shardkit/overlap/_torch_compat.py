"""The few private torch APIs this package relies on, isolated here and pinned by tests.

* ``GradBucket`` is re-exported by ``torch.distributed`` only at runtime (its stub lives in
  ``torch._C._distributed_c10d``); DDP compares a hook's ``bucket`` annotation with
  ``dist.GradBucket`` by identity, so the real class must be used, not a string.
* ``torch.autograd.Variable._execution_engine.queue_callback``: runs a function at the end of
  the current backward pass, after the callbacks queued before it (DDP queues its
  ``finalize_backward`` there). FSDP relies on it too.
* ``torch.autograd.profiler._is_profiler_enabled``: the process-wide flag every torch profiler
  entry point (``torch.profiler.profile``, ``torch.autograd.profiler.profile``, ``emit_nvtx``,
  ``emit_itt``) sets while it runs; torch's own compiler reads it to skip its ranges when nobody
  profiles. No public equivalent (``tests/test_observability.py::
  test_profiling_flag_follows_the_profiler`` pins it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.autograd.profiler as autograd_profiler
from torch._C._distributed_c10d import GradBucket

__all__ = ["GradBucket"]

logger = logging.getLogger("shardkit.overlap")
_logged_no_flag = False


def _queue_backward_callback(fn: Callable[[], None]) -> None:
    """Runs ``fn`` once the running backward pass finishes, after earlier queued callbacks.

    Must be called from inside a backward pass (an autograd hook or a DDP comm hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def profiling() -> bool:
    """Whether a torch profiler is running in this process (see [Note: Profiler ranges]).

    Where torch no longer has the flag, ranges are always opened (logged once): the same
    traces, a few microseconds more per bucket.
    """
    global _logged_no_flag
    flag = getattr(autograd_profiler, "_is_profiler_enabled", None)
    if isinstance(flag, bool):
        return flag
    if not _logged_no_flag:
        _logged_no_flag = True
        logger.info(
            "shardkit.overlap: torch.autograd.profiler._is_profiler_enabled is gone in this "
            "torch; profiler ranges are opened on every step (logged once)"
        )
    return True
