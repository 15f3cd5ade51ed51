"""Profiler ranges and once-only logs of ``shardkit.ddp`` (see [Note: Profiler ranges] in
``shardkit.ddp._profiling``).

Rank bodies cannot use pytest's ``caplog`` (they run in the world's processes):
``shardkit.testing.captured_logs("shardkit.optim")`` (the engine logs there) does its job there.
"""

from __future__ import annotations

import pytest
import torch
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import captured_logs, world
from torch import nn


def _wrapped(**kwargs: object) -> tuple[ShardedDataParallel, ShardedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    model.register_buffer("seen", torch.zeros(2))  # a buffer, so forwards broadcast it
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    return ShardedDataParallel(model, opt, reduce_buffer_size=0, **kwargs), opt  # type: ignore[arg-type]


def _step(sdp: ShardedDataParallel, opt: ShardedOptimizer, clip: bool = False) -> None:
    sdp(torch.randn(3, 5)).square().mean().backward()
    if clip:
        opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad()


@world(2)
def test_step_phases_show_in_a_profiler_trace() -> None:
    sdp, opt = _wrapped()
    _step(sdp, opt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(sdp, opt, clip=True)
    names = {e.key for e in prof.key_averages()}
    buckets = len(sdp._buckets)
    assert buckets == 4  # reduce_buffer_size=0: one bucket per param
    want = {f"shardkit.ddp.reduce_scatter[{i}]" for i in range(buckets)} | {
        "shardkit.ddp.broadcast_buffers",
        "shardkit.ddp.step",
        "shardkit.ddp.wait",
        "shardkit.ddp.local_step",
        "shardkit.ddp.all_gather",
        "shardkit.ddp.clip_grad_norm",
    }
    assert want <= names, sorted(want - names)


@world(2)
def test_deferred_param_gathers_show_in_a_profiler_trace() -> None:
    sdp, opt = _wrapped()  # overlap_param_gather: default
    sdp(torch.randn(3, 5)).square().mean().backward()
    opt.step()  # no zero_grad() (it would wait)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sdp(torch.randn(3, 5))  # forward pre-hooks wait for their own buckets' gathers
    names = {e.key for e in prof.key_averages()}
    assert {f"shardkit.ddp.wait_params[{i}]" for i in range(4)} <= names, sorted(names)


@world(2)
def test_a_profile_that_ends_after_step_keeps_the_process_alive() -> None:
    """[Note: Gloo gathers and the profiler]: a profile ending after ``step()`` (as a
    ``torch.profiler.schedule`` window ends in ``prof.step()``) with deferred Gloo gathers still
    in flight crashed torch's profiler (SIGSEGV, 3 runs of 3 at 20 iterations before the fix);
    under a profiler the gathers are waited in ``step()``, without one they stay deferred."""
    sdp, opt = _wrapped()
    with captured_logs("shardkit.optim") as logs:
        for _ in range(20):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                sdp(torch.randn(3, 5)).square().mean().backward()
                opt.step()
                assert not sdp._engine.groups[0].gather.pending  # waited inside step()
            assert "shardkit.ddp.all_gather" in {e.key for e in prof.key_averages()}
            opt.zero_grad()
    assert len(logs.matching("a torch profiler is running")) <= 1
    sdp(torch.randn(3, 5)).square().mean().backward()
    opt.step()
    assert sdp._engine.groups[0].gather.pending  # no profiler: deferred as before


@world(2)
def test_no_range_is_opened_without_a_profiler() -> None:
    """Ranges cost ~1-10 us each on a per-bucket path: none is opened when nobody profiles."""

    opened: list[str] = []

    class _Spy(torch.profiler.record_function):
        def __init__(self, name: str) -> None:
            opened.append(name)
            super().__init__(name)

    sdp, opt = _wrapped()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.profiler, "record_function", _Spy)  # profiler_range looks it up per call
        _step(sdp, opt, clip=True)
        assert opened == []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            _step(sdp, opt)
    assert "shardkit.ddp.local_step" in opened


@world(2)
def test_gloo_collectives_fallback_is_logged_once() -> None:
    import shardkit.optim._wire as comm

    with pytest.MonkeyPatch.context() as mp, captured_logs("shardkit.optim") as logs:
        mp.setattr(comm, "_logged_gloo", False)
        for _ in range(2):
            sdp, opt = _wrapped()
            _step(sdp, opt)
    found = logs.matching("reduce-scatters with point-to-point sends")
    assert len(found) == 1, found


@world(2)
def test_extra_staging_buffer_is_logged_once() -> None:
    """Three buckets receive gradients at once (the earliest-planned bucket waits for a param
    this backward does not use until the end): a third staging buffer, logged once."""
    import shardkit.optim._reducer as reducer

    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(4)])
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=0)
    with pytest.MonkeyPatch.context() as mp, captured_logs("shardkit.optim") as logs:
        mp.setattr(reducer, "_warned_extra_staging", False)
        for _ in range(2):
            x = torch.randn(2, 4)
            for layer in model[:3]:  # model[3] unused: bucket 0 (last registered) waits
                x = layer(x)
            x.sum().backward()
            opt.step()
            opt.zero_grad()
    found = logs.matching("allocating another staging buffer")
    assert len(found) == 1, found
    # all four buckets hold a buffer at the end of backward (none launches before bucket 0);
    # the pool keeps them between steps: see [Note: Staging lifetime]
    wire = sdp._engine.comm
    staging = [k for k in wire._live if k[0] == "staging"]
    assert sum(wire.live(k) for k in staging) == 4, wire._live
    assert sdp.memory_bytes()["staging"] == sdp._engine.reducer.staging_bytes() > 0
