"""``torch.profiler.record_function`` ranges around the phases of a step."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from shardkit.rpc._torch_compat import profiling

__all__ = ["phase"]

# [Note: RPC profiler ranges]
# A profiler trace shows these ranges (all under `shardkit.rpc.`):
# - trainer, `DistributedOptimizer.step`: `step` around the whole call, inside it
#   `step.request[<owner>]` per owner (sending its `rpc_async`) and
#   `step.wait` (until every owner answered, errors gathered);
# - owner, on the RPC thread that runs it: `owner.wait_turn` while a TorchScript step request
#   waits for its turn in the serial queue ([Note: Per-optimizer serial queue]) and
#   `owner.step` around applying one step (gradients lent, `optimizer.step()`).
# Owner ranges run on torch RPC's server threads, so a profiler on the owner shows them with
# `experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True)` (a plain
# profiler records only the thread that started it). A range costs ~10 us to open even when
# nobody profiles, ~5% of a small step, so ranges are only opened while a profiler runs in this
# process (`profiling()`, the flag torch's own compiler checks for its ranges).

_NO_RANGE: AbstractContextManager[None] = contextlib.nullcontext()


def phase(name: str) -> AbstractContextManager[Any]:
    """A ``record_function(name)`` range while a profiler runs here, else a no-op context."""
    if profiling():
        return torch.profiler.record_function(name)
    return _NO_RANGE
