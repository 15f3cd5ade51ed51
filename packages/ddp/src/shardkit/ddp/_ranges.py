"""``torch.profiler.record_function`` ranges around the phases of a step.

[Note: Profiler ranges]
A profiler trace of a step shows these ranges (all under ``shardkit.ddp.``):

- backward: ``reduce_scatter[<bucket>]`` around launching a bucket's reduce-scatter (from the
  post-accumulate-grad hook that completes it, or the end-of-backward flush);
- ``step`` around the whole ``optimizer.step()`` work, inside it ``wait`` (until every
  reduce-scatter has completed), ``local_step`` (the local optimizer on this rank's shards)
  and ``all_gather`` (issuing the param all-gathers, and waiting for them unless
  ``overlap_param_gather``);
- ``wait_params`` / ``wait_params[<bucket>]`` where deferred all-gathers are waited for
  (``wait_params()``, a forward pre-hook), ``clip_grad_norm``, ``broadcast_buffers``.

Ranges sit on a per-bucket path (one per bucket launch and wait), and a range costs ~1-10 us
to open even when nobody profiles, so they are opened only while a profiler runs in this
process, as shardkit-rpc does: ``shardkit.optim.profiler_range`` (shardkit-optim's [Note:
Ranges only while profiling]).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from shardkit.optim import profiler_range

__all__: list[str] = []


def phase(name: str, index: int | None = None) -> AbstractContextManager[Any]:
    """``record_function("shardkit.ddp.<name>[<index>]")`` while a profiler runs, else a no-op."""
    return profiler_range(f"shardkit.ddp.{name}", index)
