"""``live_storages``: every live tensor storage, counted once."""

from __future__ import annotations

import torch
from shardkit.testing import live_storages


def test_views_share_one_entry_and_new_tensors_are_counted() -> None:
    before = set(live_storages())
    a = torch.zeros(1000)
    views = [a[:10], a.view(10, 100), a.detach()]
    grown = {k: v for k, v in live_storages().items() if k not in before}
    assert grown == {a.untyped_storage().data_ptr(): 4000}
    del views
    b = a.clone()
    grown = {k: v for k, v in live_storages().items() if k not in before}
    assert sorted(grown.values()) == [4000, 4000]
    del a, b
    assert not {k for k in live_storages() if k not in before}


def test_extra_and_device_filter() -> None:
    before = set(live_storages())
    p = torch.nn.Parameter(torch.ones(8))
    p.sum().backward()
    counted = live_storages([p.grad, None], device_type="cpu")
    assert p.grad is not None and p.grad.untyped_storage().data_ptr() in counted
    assert not live_storages(device_type="meta")  # meta tensors never count
    assert {k for k in live_storages([p.grad]) if k not in before} >= {
        p.untyped_storage().data_ptr()
    }
