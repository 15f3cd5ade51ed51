"""Pins the torch internal used by ``shardkit.ddp._torch_compat``."""

from __future__ import annotations

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
