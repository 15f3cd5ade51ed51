"""Profiler ranges (see [Note: Profiler ranges] in ``shardkit.overlap._profiling``) and the
once-only logs of the step placements that leave the hooks ([Note: Step placement]).

Rank bodies cannot use pytest's ``caplog`` (they run in the world's processes):
``shardkit.testing.captured_logs("shardkit.overlap")`` does its job there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedGradScaler, ShardedOptimizer
from shardkit.overlap import ZeroOverlap, register_zero_overlap
from shardkit.testing import captured_logs, world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

CAP_MB = 0.0006  # ~600 bytes: several buckets once DDP rebuilds them


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )


def _setup(**kwargs: Any) -> tuple[DDP, ZeroOverlap]:
    find_unused = kwargs.pop("find_unused_parameters", False)
    ddp = DDP(_net(), bucket_cap_mb=CAP_MB, find_unused_parameters=find_unused)
    zero = ShardedOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    return ddp, register_zero_overlap(ddp, zero, **kwargs)


def _step(ddp: DDP, overlap: ZeroOverlap) -> None:
    g = torch.Generator().manual_seed(dist.get_rank())
    ddp(torch.randn(4, 6, generator=g)).square().mean().backward()
    overlap.step()
    overlap.zero.zero_grad()


@world(2)
@pytest.mark.parametrize("interleaved", [True, False])
def test_hook_phases_show_in_a_profiler_trace(interleaved: bool) -> None:
    ddp, overlap = _setup(interleaved=interleaved)
    _step(ddp, overlap)  # DDP rebuilds its buckets after the first iteration
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(ddp, overlap)
    names = {e.key for e in prof.key_averages()}
    buckets = sorted(int(n[len("shardkit.overlap.reduce[") : -1]) for n in names
                     if n.startswith("shardkit.overlap.reduce["))  # fmt: skip
    assert len(buckets) >= 2 and buckets == list(range(len(buckets))), sorted(names)
    want = {f"shardkit.overlap.{p}[{i}]" for p in ("reduce", "sync") for i in buckets}
    want |= {"shardkit.overlap.wait[0]", "shardkit.overlap.local_step[0]"}  # rank-owned
    if dist.get_rank() == 0:  # bucket 0 (the last layers) belongs to rank 0 here
        assert want <= names, sorted(want - names)
    else:
        assert {n for n in want if "reduce" in n or "sync" in n} <= names, sorted(names)
        assert any(n.startswith("shardkit.overlap.local_step[") for n in names), sorted(names)


@world(2)
def test_deferred_step_phases_show_in_a_profiler_trace() -> None:
    ddp, overlap = _setup(find_unused_parameters=True)
    _step(ddp, overlap)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(ddp, overlap)
    names = {e.key for e in prof.key_averages()}
    want = {"shardkit.overlap.reduce[0]", "shardkit.overlap.local_step", "shardkit.overlap.sync"}
    assert want <= names, sorted(want - names)


@world(2)
def test_no_range_is_opened_without_a_profiler() -> None:

    opened: list[str] = []

    class _Spy(torch.profiler.record_function):
        def __init__(self, name: str) -> None:
            opened.append(name)
            super().__init__(name)

    ddp, overlap = _setup()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.profiler, "record_function", _Spy)  # profiler_range looks it up per call
        _step(ddp, overlap)
        assert opened == []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            _step(ddp, overlap)
    assert "shardkit.overlap.reduce[0]" in opened


@world(2)
def test_step_placements_outside_the_hooks_are_logged_once() -> None:
    import shardkit.overlap._overlap as ov

    with pytest.MonkeyPatch.context() as mp, captured_logs("shardkit.overlap") as logs:
        mp.setattr(ov, "_logged_loop_step", False)
        mp.setattr(ov, "_logged_deferred", False)
        for _ in range(2):
            ddp, overlap = _setup()  # per-bucket step: nothing logged
            overlap.close()
        assert logs.records == []
        for _ in range(2):
            ddp, overlap = _setup(max_grad_norm=1.0)
            _step(ddp, overlap)
        scaler = ShardedGradScaler("cpu", group=overlap.zero.group)
        _setup(grad_scaler=scaler)
        for _ in range(2):
            ddp, overlap = _setup(find_unused_parameters=True)
            _step(ddp, overlap)
    loop = logs.matching("runs in the training loop after backward")
    assert len(loop) == 1 and "max_grad_norm=1.0" in loop[0], loop
    deferred = logs.matching("find_unused_parameters=True, so the sharded step runs once")
    assert len(deferred) == 1, deferred
