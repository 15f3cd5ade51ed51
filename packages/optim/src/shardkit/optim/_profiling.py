"""``torch.profiler.record_function`` ranges around the phases of a step, for every ZeRO mode.

[Note: Profiler ranges]
A profiler trace of a training step shows where its time goes, in ranges named
``shardkit.<package>.<phase>`` (``[<bucket>]`` appended on a per-bucket path): shardkit-optim's
ZeRO-1 step (``agree``, ``local_step``, ``sync``, ``clip_grad_norm``, ``consolidate``), and the
ranges that shardkit-ddp and shardkit-overlap list in their own ``_profiling`` modules. A range
costs about 1-10 us to open even when nobody profiles, which adds up on a per-bucket path (one
range per bucket launch and wait), so every range is opened only while a torch profiler records
(torch's own flag, :func:`profiling`), and a bucket's name is formatted only then. The ZeRO-2
engine's per-step and per-bucket paths ask first, ``phase(...) if profiling() else NO_RANGE``:
``profiling`` is torch's C function, so a step that nobody profiles runs no frame of this
module. shardkit-rpc, which stands alone, does the same with its
own copy of the flag.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from shardkit.optim._torch_compat import profiling

__all__ = ["NO_RANGE", "profiler_range", "profiling", "zero2_phase"]

NO_RANGE: AbstractContextManager[None] = contextlib.nullcontext()
"""The shared no-op range (reusable: ``nullcontext`` keeps no state)."""


def profiler_range(name: str, index: int | None = None) -> AbstractContextManager[Any]:
    """``record_function("<name>[<index>]")`` while a torch profiler runs, else a no-op.

    See [Note: Profiler ranges].

    Args:
        name: the range's full name (e.g. ``"shardkit.ddp.reduce_scatter"``).
        index: appended as ``[index]`` (e.g. a bucket index) when given.
    """
    if not profiling():
        return NO_RANGE
    return torch.profiler.record_function(name if index is None else f"{name}[{index}]")


def zero2_phase(name: str, index: int | None = None) -> AbstractContextManager[Any]:
    """A range of the ZeRO-2 engine, named under ``shardkit.ddp.`` (the wrapper users see;
    the names are listed in ``shardkit.ddp._profiling``); see [Note: Profiler ranges]."""
    return profiler_range(f"shardkit.ddp.{name}", index)
