"""Training and comparison helpers shared by shardkit-optim's state and checkpoint tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["assert_state_equal", "train"]


def train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0, batch: int = 8
) -> None:
    """Run ``steps`` MSE steps of ``model`` (Linear in, Linear out) on seeded batches.

    Step ``s`` draws its batch from a generator seeded with ``s``, so a run resumed at ``start``
    sees the same data as an uninterrupted one.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    n_in, n_out = linears[0].in_features, linears[-1].out_features
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(batch, n_in, generator=g), torch.randn(batch, n_out, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def assert_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two plain optimizer state dicts are equal: groups, keys, and every tensor bit for bit."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape, (i, k)
                assert torch.equal(v.cpu(), w.cpu()), (i, k)
            else:
                assert v == w, (i, k)
