"""How much of shardkit one ZeRO-2 step walks through (issue 47's structural target).

One steady-state step of ``ShardedDataParallel`` at world 2 with default options (forward,
backward, ``optimizer.step()``, the next forward) is traced with ``sys.settrace`` on every
rank; rank 0's trace is counted: the shardkit source files the step enters, and the distinct
(caller file, callee file) pairs whose files belong to different distributions. A frame belongs
to shardkit when its module is ``shardkit.<distribution>...``; its distribution is that second
name component, so the count holds for editable and installed packages alike.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn

MAX_FILES = 12
"""Shardkit source files one step enters, at most (main 0602a9f: 23; after issue 47's owner
move: 21; after issue 48's one masters / one numbering and the hooks recorded instead of
wrapped: 18; one agreement module with its transport, the gathers with their access guard,
torch's own C functions for the internals a step calls, ranges built only under a profiler,
placeholders and layout fields read without a call: 12, issue 47's target)."""
MAX_CROSS_PAIRS = 4
"""Distinct (caller, callee) file pairs across distributions, at most (main 0602a9f: 12; issue
47's target: 4; after the owner moved into shardkit-optim: 2)."""


def _distribution(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if not isinstance(name, str) or not name.startswith("shardkit."):
        return None
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "testing" else None


class StepTrace:
    """Counts the shardkit files entered and the cross-distribution call pairs."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.cross: set[tuple[str, str]] = set()
        self.calls = 0

    def _short(self, frame: FrameType) -> str:
        name: str = frame.f_globals["__name__"]
        return name.removeprefix("shardkit.")

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event != "call":
            return None
        dist_name = _distribution(frame)
        if dist_name is None:
            return None
        self.calls += 1
        callee = self._short(frame)
        self.files.add(callee)
        caller = frame.f_back
        if caller is not None:
            caller_dist = _distribution(caller)
            if caller_dist is not None and caller_dist != dist_name:
                self.cross.add((self._short(caller), callee))
        return None

    def __enter__(self) -> StepTrace:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    # a buffer (BatchNorm's running statistics): the forward broadcasts rank 0's buffers
    return nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 4),
    )


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(8, 16, generator=g)


def trace_one_step(zero_grad_first: bool = False) -> StepTrace:
    """Warms up one step, then traces forward, backward, ``step()`` and the next forward
    (with ``zero_grad()`` before it when ``zero_grad_first``, else after it: the ``.grad``
    placeholders are still there when it runs)."""
    model = _net()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
    sdp = ShardedDataParallel(model, opt)
    sdp(_batch(0)).sum().backward()
    opt.step()
    opt.zero_grad()
    with StepTrace() as trace:
        sdp(_batch(1)).sum().backward()
        opt.step()
        if zero_grad_first:
            opt.zero_grad()
        out = sdp(_batch(2))
    opt.zero_grad()
    out.sum().backward()
    opt.step()
    sdp.wait_params()
    return trace


@pytest.mark.parametrize("zero_grad_first", [False, True])
@world(2)
def test_one_zero2_step_walks_few_files_and_crosses_few_edges(zero_grad_first: bool) -> None:
    trace = trace_one_step(zero_grad_first)
    if dist.get_rank() != 0:
        return
    report = (
        f"{len(trace.files)} files: {sorted(trace.files)}; {len(trace.cross)} cross pairs: "
        f"{sorted(trace.cross)}"
    )
    print(report)
    assert trace.calls > 0, "the tracer saw no shardkit call"
    assert len(trace.files) <= MAX_FILES, report
    assert len(trace.cross) <= MAX_CROSS_PAIRS, report
