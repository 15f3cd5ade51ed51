"""shardkit-buckets' library logging: a silent fallback is logged once (``shardkit.buckets``)."""

from __future__ import annotations

import logging

import pytest
import torch
from shardkit.buckets import GradBucket


def test_grads_copied_back_into_the_bucket_are_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkit.buckets._grad_bucket as gb

    monkeypatch.setattr(gb, "_logged_copied_grads", False)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    bucket = GradBucket(8, torch.float32, "cpu")
    for p in params:
        bucket.add_grad(p, name="w" if p.dim() == 2 else "b")
    x = torch.randn(4, 3)
    with caplog.at_level(logging.INFO, logger="shardkit.buckets"):
        bucket.reattach()  # views already attached: nothing copied, nothing logged
        assert not caplog.records
        for _ in range(2):
            for p in params:
                p.grad = None
            model(x).sum().backward()  # fresh grads, not views of the bucket
            bucket.reattach()  # copies them in
    messages = [r.getMessage() for r in caplog.records if r.name == "shardkit.buckets"]
    assert len(messages) == 1, messages
    assert "2 grad(s) were not views of the bucket" in messages[0] and "'w'" in messages[0]
