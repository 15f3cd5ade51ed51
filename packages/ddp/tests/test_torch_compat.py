"""Pins the torch internal used by ``shardkit.ddp._torch_compat``."""

from __future__ import annotations

import logging

import pytest
import torch
from shardkit.ddp._torch_compat import queue_end_of_backward


def test_queue_callback_runs_after_every_hook() -> None:
    events: list[str] = []
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    unused = torch.nn.Parameter(torch.ones(3))

    def hook(p: torch.Tensor) -> None:
        name = "a" if p is a else "b"
        events.append(name)
        if len(events) == 1:
            queue_end_of_backward(lambda: events.append("end"))

    for p in (a, b, unused):
        p.register_post_accumulate_grad_hook(hook)
    ((a * 2).sum() + (b * 3).sum()).backward()
    assert sorted(events[:2]) == ["a", "b"] and events[2:] == ["end"]
    events.clear()
    (a * 2).sum().backward()
    assert events == ["a", "end"]


def test_profiling_flag_follows_the_profiler() -> None:
    """Pins torch.autograd.profiler._is_profiler_enabled (see _torch_compat.py): set by both
    profiler entry points while they run, process-wide."""
    from shardkit.ddp._torch_compat import profiling

    assert profiling() is False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert profiling() is True
    assert profiling() is False
    with torch.autograd.profiler.profile():
        assert profiling() is True
    assert profiling() is False


def test_profiling_without_the_flag_opens_ranges_and_logs_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkit.ddp._torch_compat as compat

    monkeypatch.setattr(compat, "_logged_no_flag", False)
    monkeypatch.delattr(torch.autograd.profiler, "_is_profiler_enabled")
    with caplog.at_level(logging.INFO, logger="shardkit.ddp"):
        assert compat.profiling() is True and compat.profiling() is True
    found = [
        r.getMessage() for r in caplog.records if "_is_profiler_enabled is gone" in r.getMessage()
    ]
    assert len(found) == 1, found
