"""Pins the torch internals read by ``shardkit.optim._torch_compat`` (shared by ddp/overlap)."""

from __future__ import annotations

import logging

import pytest
import torch
from shardkit.optim import profiler_range, queue_end_of_backward


def test_queue_callback_runs_after_every_hook() -> None:
    """Once per backward, after every param's post-accumulate-grad hook of the pass."""
    events: list[str] = []
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    unused = torch.nn.Parameter(torch.ones(3))

    def hook(p: torch.Tensor) -> None:
        events.append("a" if p is a else "b")
        if len(events) == 1:
            queue_end_of_backward(lambda: events.append("end"))

    for p in (a, b, unused):
        p.register_post_accumulate_grad_hook(hook)
    ((a * 2).sum() + (b * 3).sum()).backward()
    assert sorted(events[:2]) == ["a", "b"] and events[2:] == ["end"]
    events.clear()
    (a * 2).sum().backward()
    assert events == ["a", "end"]


def test_queue_callback_from_a_tensor_hook_runs_after_it() -> None:
    order: list[str] = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> None:
        queue_end_of_backward(lambda: order.append("callback"))
        order.append("hook")

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert order == ["hook", "callback"]


def test_profiling_flag_follows_the_profiler() -> None:
    """Pins ``torch.autograd.profiler._is_profiler_enabled``: set by both profiler entry
    points while they run, process-wide; ranges open only then."""
    from shardkit.optim._torch_compat import profiling

    assert profiling() is False
    assert isinstance(profiler_range("x"), type(profiler_range("y")))  # the shared no-op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert profiling() is True
        with profiler_range("shardkit.test.phase", 3):
            torch.ones(1).add_(1)
    assert profiling() is False
    assert "shardkit.test.phase[3]" in {e.name for e in prof.events()}
    with torch.autograd.profiler.profile():
        assert profiling() is True
    assert profiling() is False


def test_profiling_without_the_flag_opens_ranges_and_logs_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkit.optim._torch_compat as compat

    monkeypatch.setattr(compat, "_logged_no_flag", False)
    monkeypatch.delattr(torch.autograd.profiler, "_is_profiler_enabled")
    with caplog.at_level(logging.INFO, logger="shardkit.optim"):
        assert compat.profiling() is True and compat.profiling() is True
    found = [
        r.getMessage() for r in caplog.records if "_is_profiler_enabled is gone" in r.getMessage()
    ]
    assert len(found) == 1, found
