"""The profiler ranges of ``ShardedDataParallel`` (shardkit-optim's [Note: Profiler ranges]);
all but ``broadcast_buffers`` are opened by shardkit-optim's ZeRO-2 engine (``zero2_phase``).

A profiler trace of a step shows, under ``shardkit.ddp.``:

- backward: ``reduce_scatter[<bucket>]`` around launching a bucket's reduce-scatter (from the
  post-accumulate-grad hook that completes it, or the end-of-backward flush);
- ``step`` around the whole ``optimizer.step()`` work, inside it ``wait`` (until every
  reduce-scatter has completed), ``usage`` (the all-reduce of which params were used),
  ``local_step`` (the local optimizer on this rank's shards) and ``all_gather`` (issuing the
  param all-gathers, and waiting for them unless ``overlap_param_gather``);
- ``wait_params`` / ``wait_params[<bucket>]`` where deferred all-gathers are waited for
  (``wait_params()``, a forward pre-hook, the param-access guard), ``clip_grad_norm``,
  ``broadcast_buffers``.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

from shardkit.optim import profiler_range, profiling

__all__ = ["NO_RANGE", "phase", "profiling"]

NO_RANGE: AbstractContextManager[None] = contextlib.nullcontext()
"""The no-op range a per-forward path uses without a call when nobody profiles:
``phase(...) if profiling() else NO_RANGE`` (``profiling`` is torch's C flag)."""


def phase(name: str, index: int | None = None) -> AbstractContextManager[Any]:
    """``record_function("shardkit.ddp.<name>[<index>]")`` while a profiler runs, else a no-op."""
    return profiler_range(f"shardkit.ddp.{name}", index)
