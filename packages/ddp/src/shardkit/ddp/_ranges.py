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
process (``profiling()`` in ``_torch_compat``), as shardkit-rpc does. The bucket's name is
formatted only then.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from shardkit.ddp._torch_compat import profiling

__all__: list[str] = []

_NO_RANGE: AbstractContextManager[None] = contextlib.nullcontext()


def phase(name: str, index: int | None = None) -> AbstractContextManager[Any]:
    """``record_function("shardkit.ddp.<name>[<index>]")`` while a profiler runs, else a no-op."""
    if not profiling():
        return _NO_RANGE
    full = f"shardkit.ddp.{name}" if index is None else f"shardkit.ddp.{name}[{index}]"
    return torch.profiler.record_function(full)
