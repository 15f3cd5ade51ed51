"""shardkit-offload's profiler ranges and library logging (``shardkit.offload``)."""

from __future__ import annotations

import logging

import pytest
import torch
from shardkit.offload import OffloadModel
from torch import nn


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_phases_show_in_a_profiler_trace(checkpoint: bool) -> None:
    model = OffloadModel(
        _layers(),
        "cpu",
        num_slices=3,
        checkpoint_activation=checkpoint,
        stage_on_same_device=True,
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.randn(5, 8)).sum().backward()
    names = {e.name for e in prof.events()}
    want = {
        "shardkit.offload.forward",
        "shardkit.offload.backward",
        "shardkit.offload.load",
        "shardkit.offload.evict",
        "shardkit.offload.compute",
    } | ({"shardkit.offload.recompute"} if checkpoint else set())
    assert want <= names, sorted(want - names)


def test_running_in_place_is_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkit.offload._model as m

    monkeypatch.setattr(m, "_logged_in_place", False)
    with caplog.at_level(logging.INFO, logger="shardkit.offload"):
        OffloadModel(_layers(), "cpu", num_slices=2, stage_on_same_device=True)
        assert not caplog.records  # staged: the transfer path runs, nothing to report
        OffloadModel(_layers(), "cpu", num_slices=2)
        OffloadModel(_layers(), "cpu", num_slices=2)
    messages = [r.getMessage() for r in caplog.records if r.name == "shardkit.offload"]
    assert len(messages) == 1 and "run in place" in messages[0], messages
