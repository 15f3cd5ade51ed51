"""``torch.profiler.record_function`` ranges around the phases of an overlapped step.

[Note: Profiler ranges]
A profiler trace shows these ranges (all under ``shardkit.overlap.``), per DDP bucket index:
``reduce[<bucket>]`` around launching the bucket's reduction (the wrapped hook, or the reduces
to the owners), ``wait[<bucket>]`` until the reduction has completed (owners only),
``local_step[<bucket>]`` (the ShardedOptimizer's local step on the owned params of the bucket)
and ``sync[<bucket>]`` (launching the owners' broadcasts of the bucket's params). With
``find_unused_parameters=True`` the step runs once after backward: ``local_step`` and ``sync``
without an index. In loop-step mode (scaler, clipping) only ``reduce[<bucket>]`` is ours; the
step shows shardkit-optim's ranges.

The ranges sit on the comm hook's per-bucket path, and a range costs ~1-10 us to open even
when nobody profiles, so they are opened only while a profiler runs in this process
(``shardkit.optim.profiler_range``, shardkit-optim's [Note: Ranges only while profiling]), as
shardkit-rpc does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from shardkit.optim import profiler_range

__all__: list[str] = []


def phase(name: str, index: int | None = None) -> AbstractContextManager[Any]:
    """``record_function("shardkit.overlap.<name>[<index>]")`` while a profiler runs, else a no-op."""
    return profiler_range(f"shardkit.overlap.{name}", index)
