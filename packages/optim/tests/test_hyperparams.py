"""[Note: One owner of hyper-parameters]: the wrapped optimizer reads and writes the front's
param groups through views; nothing is copied either way around a step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.optim._state import GroupView, share_hyperparams
from shardkit.testing import world
from torch import nn


class _CountingSGD(torch.optim.Optimizer):
    """Writes its param group inside ``step`` (as apex's FusedAdam counts ``group["step"]``):
    the update is ``lr / count`` times the gradient."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / group["count"])
        return None


def test_a_view_is_a_param_group_of_the_front() -> None:
    p, q = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    front = {"params": [p, q], "lr": 0.1}
    view = GroupView(front, [q])
    assert view["params"] == [q] and view["lr"] == 0.1 and len(view) == 2
    assert list(view) == ["params", "lr"] and dict(view) == {"params": [q], "lr": 0.1}
    view["lr"] = 0.2
    view.setdefault("momentum", 0.9)
    assert front == {"params": [p, q], "lr": 0.2, "momentum": 0.9}
    view["params"] = []
    assert front["params"] == [p, q]
    with pytest.raises(KeyError, match="keeps its 'params'"):
        del view["params"]
    opt = torch.optim.Adam([{"params": [q], "lr": 0.3}], betas=(0.8, 0.9))
    share_hyperparams([front], opt)  # the front's lr wins, Adam's defaults fill the front
    assert opt.param_groups[0]["lr"] == 0.2 and front["betas"] == (0.8, 0.9)
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize("zero2", [False, True], ids=["zero1", "zero2"])
@world(2)
def test_an_optimizer_that_writes_its_group_in_step_matches_a_plain_one(zero2: bool) -> None:
    ref_model, model = _model(), _model()
    ref = _CountingSGD(ref_model.parameters(), lr=0.1)
    opt = ShardedOptimizer(model.parameters(), optim=_CountingSGD, lr=0.1)
    run: nn.Module = ShardedDataParallel(model, opt) if zero2 else model
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    for step in range(4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))  # same on every rank
        ref_model(x).square().mean().backward()
        run(x).square().mean().backward()
        ref.step()
        opt.step()
        ref.zero_grad()
        opt.zero_grad()
        sched.step()
        ref_sched.step()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    # the count the local optimizer kept is the front's, the same on every rank
    assert opt.param_groups[0]["count"] == ref.param_groups[0]["count"] == 4
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 0.1 * 0.5**4
    counts = [None, None]
    dist.all_gather_object(counts, opt.param_groups[0]["count"])
    assert counts == [4, 4]
