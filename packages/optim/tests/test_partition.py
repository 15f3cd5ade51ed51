"""The entry points shardkit-overlap drives: imposed partitions, exact syncs, external steppers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer, StepDriver
from shardkit.testing import world
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _backward(model: nn.Module, step: int = 0) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(3, 4, generator=g)).square().sum().backward()


@world(2)
def test_set_partition_moves_state_and_persists() -> None:
    model = _model()
    ref_model = copy.deepcopy(model)
    zero = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.1)
    for m, o in ((model, zero), (ref_model, ref)):
        _backward(m)
        o.step()
        o.zero_grad()
    before = zero.state_dict(all_ranks=True)
    n = len(list(model.parameters()))
    owners = [(i + 1) % 2 for i in range(n)]
    order = list(reversed(range(n)))
    zero.set_partition(owners, sync_order=order)
    assert zero.shard_layout.owner == tuple(owners) and zero.shard_layout.order == tuple(order)
    assert {id(p) for p in zero.owned_params} == {
        id(p) for i, p in enumerate(model.parameters()) if owners[i] == dist.get_rank()
    }
    after = zero.state_dict(all_ranks=True)
    for i, st in before["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(after["state"][i][k], v, rtol=0, atol=0)
    # the imposed partition survives a rebuild with unchanged params, and training stays exact
    zero.refresh_trainable()
    assert zero.shard_layout.owner == tuple(owners)
    for s in range(1, 3):
        for m, o in ((model, zero), (ref_model, ref)):
            _backward(m, s)
            o.step()
            o.zero_grad()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    # freezing a param changes the mask: the partition algorithm takes over again
    next(iter(model.parameters())).requires_grad_(False)
    zero.refresh_trainable()
    assert zero._imposed is None


@world(2)
def test_set_partition_errors_raise_everywhere() -> None:
    zero = ShardedOptimizer(_model().parameters(), torch.optim.SGD, lr=0.1)
    n = len(zero.shard_layout.params)
    with pytest.raises(TypeError, match="owners must be a sequence"):
        zero.set_partition(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"optimizer holds {n} params"):
        zero.set_partition([0] * (n - 1))
    with pytest.raises(ValueError, match=r"ints in \[0, 2\)"):
        zero.set_partition([0] * (n - 1) + [2])
    with pytest.raises(ValueError, match="distinct global param indices"):
        zero.set_partition([0] * n, sync_order=[0, 0])
    with pytest.raises(TypeError, match="sync_order must be a sequence"):
        zero.set_partition([0] * n, sync_order="01")  # type: ignore[arg-type]
    # ranks passing different owners: every rank raises, nobody hangs
    with pytest.raises(ValueError, match="ranks disagree on set_partition"):
        zero.set_partition([dist.get_rank()] * n)


@world(2)
def test_sync_params_exact_runs() -> None:
    """One broadcast per (unit, owner) run; params not asked for are never touched."""
    model = _model()
    params = list(model.parameters())
    zero = ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
    # two "buckets": {4, 5, 0} and {1, 2, 3}, each split across both ranks
    units = [[4, 5, 0], [1, 2, 3]]
    owners = [0, 1, 0, 1, 0, 1]
    zero.set_partition(owners, sync_order=[i for u in units for i in u])
    for u in units:
        want = {owners[i] for i in u}
        works = zero.sync_params([params[i] for i in u], async_op=True)
        assert len(works) == len(want)
        for w in works:
            w.wait()
    # a non-owner's values of params outside the synced unit stay as they are
    with torch.no_grad():
        for i, p in enumerate(params):
            if owners[i] != dist.get_rank():
                p.fill_(-7.0)
            else:
                p.fill_(float(i))
    for w in zero.sync_params([params[i] for i in units[0]], async_op=True):
        w.wait()
    for i, p in enumerate(params):
        if owners[i] == dist.get_rank():
            assert torch.all(p == float(i))
        elif i in units[0]:
            assert torch.all(p == float(i)), i  # received from its owner
        else:
            assert torch.all(p == -7.0), i  # not asked for: untouched
    # params outside any buffer layout order (one param, reversed order) still work
    for w in zero.sync_params([params[3], params[1]], async_op=True):
        w.wait()
    assert torch.all(params[1] == 1.0) and torch.all(params[3] == 3.0)


@world(2)
def test_step_local_subset_and_external_stepper() -> None:
    model = _model()
    ref_model = copy.deepcopy(model)
    zero = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    _backward(model)
    _backward(ref_model)
    params = list(model.parameters())
    subset = params[:3]
    zero.step_local(subset)
    for w in zero.sync_params(subset, async_op=True):
        w.wait()
    ref_params = list(ref_model.parameters())
    ref_sub = torch.optim.SGD(ref_params[:3], lr=0.1, momentum=0.9)
    ref_sub.step()
    for a, b in zip(ref_params, params, strict=True):
        assert torch.equal(a, b)  # the subset stepped, the rest unchanged (still initial)
    # the step-driver contract (shardkit.optim.StepDriver)
    driver = _MarkDriver(zero, "test hook")
    zero.attach_driver(driver)
    assert zero.driver is driver
    with pytest.raises(RuntimeError, match="already driven by test hook"):
        zero.attach_driver(_MarkDriver(zero, "another"))
    with pytest.raises(TypeError, match=r"must be a shardkit\.optim\.StepDriver"):
        ShardedOptimizer(_model().parameters(), torch.optim.SGD, lr=0.1).attach_driver(object())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"no backward ran"):
        zero.step()
    driver.marked = True
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="closure"):
        zero.step(lambda: 0.0)
    assert zero.step() is None
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    with pytest.raises(RuntimeError, match=r"no backward ran"):
        zero.step()
    zero.detach_driver()
    assert zero.driver is None
    zero.step()  # a normal step again
    assert any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))


class _MarkDriver(StepDriver):
    """A minimal driver: steps are "done elsewhere" once ``marked``; refuses otherwise."""

    def __init__(self, zero: ShardedOptimizer, name: str) -> None:
        self.zero, self.name, self.marked = zero, name, False

    def step(self, closure: Any = None, **kwargs: Any) -> None:
        error = None
        if closure is not None:
            error = "a closure is refused by this driver"
        elif not self.marked:
            error = f"rank {self.zero.rank}: no backward ran since the last step"
        self.zero.check_step(error)
        self.marked = False
