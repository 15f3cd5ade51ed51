"""ShardedOptimizer vs DDP + the plain optimizer: bit-for-bit parameter parity (Gloo)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import OSS, ShardedOptimizer
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class _SignSGD(torch.optim.Optimizer):
    """A custom optimizer with state and an extra step kwarg."""

    def __init__(self, params: Any, lr: float = 0.01, decay: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "decay": decay})

    @torch.no_grad()
    def step(self, closure: Any = None, scale: float = 1.0) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "avg" not in st:
                    st["avg"] = torch.zeros_like(p)
                    st["count"] = 0
                st["avg"].mul_(group["decay"]).add_(p.grad)
                st["count"] += 1
                p.add_(st["avg"].sign(), alpha=-group["lr"] * scale)
        return loss


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 3, bias=False),
        nn.Linear(3, 2),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _groups(model: nn.Module, two_groups: bool, lrs: tuple[float, float]) -> Any:
    params = list(model.parameters())
    if not two_groups:
        return params
    return [{"params": params[:3], "lr": lrs[0]}, {"params": params[3:], "lr": lrs[1]}]


def _run_pair(
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    *,
    steps: int = 4,
    two_groups: bool = False,
    scheduler: bool = False,
    closure: bool = False,
    step_kwargs: dict[str, Any] | None = None,
    fp16: bool = False,
    group: Any = None,
    algorithm: str = "sorted_greedy",
) -> tuple[nn.Module, nn.Module, ShardedOptimizer]:
    lrs = (kwargs.get("lr", 0.01), kwargs.get("lr", 0.01) * 3)
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model, process_group=group)
    ddp = DDP(model, process_group=group)
    ref_opt = cls(_groups(ref_model, two_groups, lrs), **kwargs)
    opt = ShardedOptimizer(
        _groups(model, two_groups, lrs),
        optim=cls,
        group=group,
        broadcast_fp16=fp16,
        partition_algorithm=algorithm,
        **kwargs,
    )
    scheds = []
    if scheduler:
        scheds = [
            torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ref_opt, opt)
        ]
    sk = step_kwargs or {}
    for s in range(steps):
        x, y = _batch(s)
        for net, o in ((ref, ref_opt), (ddp, opt)):

            def fn(
                net: nn.Module = net,
                o: torch.optim.Optimizer = o,
                x: torch.Tensor = x,
                y: torch.Tensor = y,
            ) -> torch.Tensor:
                o.zero_grad()
                loss = nn.functional.mse_loss(net(x), y)
                loss.backward()
                return loss

            if closure:
                loss = o.step(fn, **sk)
                assert isinstance(loss, torch.Tensor)
            else:
                fn()
                o.step(**sk)
        for sch in scheds:
            sch.step()
    return ref_model, model, opt


def _assert_same(ref: nn.Module, model: nn.Module) -> None:
    for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"


_OPTIMS = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    (torch.optim.Adagrad, {"lr": 0.05}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (_SignSGD, {"lr": 0.01}),
]


@pytest.mark.parametrize("cls,kwargs", _OPTIMS, ids=lambda v: getattr(v, "__name__", ""))
@world(2)
def test_parity_with_ddp(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
    ref, model, opt = _run_pair(cls, kwargs, two_groups=True)
    _assert_same(ref, model)
    # each rank holds state only for the params it owns
    owned = set(map(id, opt.owned_params))
    assert {id(p) for p in opt.optim.state} <= owned
    assert 0 < len(owned) < len(list(model.parameters()))


@world(3)
def test_parity_world3_scheduler_closure_kwargs() -> None:
    ref, model, opt = _run_pair(
        _SignSGD,
        {"lr": 0.02},
        two_groups=True,
        scheduler=True,
        closure=True,
        step_kwargs={"scale": 0.5},
    )
    _assert_same(ref, model)
    # the scheduler's changes reached the local optimizer and back
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5**4)
    # one owner of the hyper-parameters: the local optimizer reads the wrapper's groups
    assert (
        opt.optim.param_groups[1]["lr"] == opt.param_groups[1]["lr"] == pytest.approx(0.06 * 0.5**4)
    )
    opt.param_groups[1]["lr"] = 0.5
    assert opt.optim.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize("algorithm", ["greedy", "balanced"])
@world(4)
def test_parity_world4_algorithms(algorithm: str) -> None:
    ref, model, opt = _run_pair(torch.optim.Adam, {"lr": 0.01}, algorithm=algorithm, steps=3)
    _assert_same(ref, model)
    owners = set(opt.param_to_rank.values())
    assert owners == {0, 1, 2, 3}


@world(2)
def test_hyperparams_visible_and_oss_subclass() -> None:
    assert issubclass(OSS, ShardedOptimizer)  # fairscale's constructor, same optimizer
    model = _model()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    # defaults of the wrapped optimizer show up on the wrapper (for schedulers, logging)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert opt.rank == dist.get_rank() and opt.world_size == 2
    parts = opt.partition_parameters()
    assert len(parts) == 2
    flat = [p for r in parts for g in r for p in g["params"]]
    assert sorted(map(id, flat)) == sorted(map(id, model.parameters()))


@world(2)
def test_broadcast_fp16_owner_keeps_fp32() -> None:
    ref, model, opt = _run_pair(torch.optim.SGD, {"lr": 0.1}, fp16=True, steps=1)
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        if opt.param_to_rank[b] == opt.rank:
            assert torch.equal(a, b)  # owner: exact
        else:
            assert torch.equal(b, a.half().float())  # receiver: the fp16 rounding of the owner's
