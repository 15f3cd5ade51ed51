"""The profiler ranges of an overlapped step (shardkit-optim's [Note: Profiler ranges]).

A profiler trace shows these ranges (all under ``shardkit.overlap.``), per DDP bucket index:
``reduce[<bucket>]`` around launching the bucket's reduction (the wrapped hook, or the reduces
to the owners), ``wait[<bucket>]`` until the reduction has completed (owners only),
``local_step[<bucket>]`` (the ShardedOptimizer's local step on the owned params of the bucket)
and ``sync[<bucket>]`` (launching the owners' broadcasts of the bucket's params). With
``find_unused_parameters=True`` the step runs once after backward: ``local_step`` and ``sync``
without an index. In loop-step mode (scaler, clipping) only ``reduce[<bucket>]`` is ours; the
step shows shardkit-optim's ranges.

They sit on the comm hook's per-bucket path: opened only while a profiler runs
(``shardkit.optim.profiler_range``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from shardkit.optim import profiler_range

__all__: list[str] = []


def phase(name: str, index: int | None = None) -> AbstractContextManager[Any]:
    """``record_function("shardkit.overlap.<name>[<index>]")`` while a profiler runs, else a no-op."""
    return profiler_range(f"shardkit.overlap.{name}", index)
