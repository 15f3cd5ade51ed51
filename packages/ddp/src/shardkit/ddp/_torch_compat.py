"""The one place shardkit-ddp reads torch internals.

``queue_end_of_backward(fn)``: runs ``fn`` once the autograd engine has finished the current
backward pass, by ``torch.autograd.Variable._execution_engine.queue_callback`` (what torch's DDP
and FSDP use for the same purpose). There is no public equivalent: a post-accumulate-grad hook
fires per param, and params unused in this backward fire none, so the end of the pass cannot be
seen otherwise. ``tests/test_torch_compat.py::test_queue_callback_runs_after_every_hook`` pins
that the callback runs once, after every param's post-accumulate-grad hook of the pass.

``profiling()``: ``torch.autograd.profiler._is_profiler_enabled``, the process-wide flag every
torch profiler entry point (``torch.profiler.profile``, ``torch.autograd.profiler.profile``,
``emit_nvtx``, ``emit_itt``) sets while it runs; torch's own compiler reads it to skip its
ranges when nobody profiles. There is no public equivalent.
``tests/test_torch_compat.py::test_profiling_flag_follows_the_profiler`` pins it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.autograd.profiler as autograd_profiler
from torch.autograd import Variable

__all__: list[str] = []

logger = logging.getLogger("shardkit.ddp")
_logged_no_flag = False


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Queues ``fn`` to run at the end of the running backward pass (call from a backward hook)."""
    Variable._execution_engine.queue_callback(fn)


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
            "shardkit.ddp: torch.autograd.profiler._is_profiler_enabled is gone in this torch; "
            "profiler ranges are opened on every step (logged once)"
        )
    return True
