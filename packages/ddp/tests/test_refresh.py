"""``requires_grad`` changes after construction: the layout is rebuilt and training goes on as a
plain optimizer with DDP-averaged gradients would (see [Note: Trainable refresh]).

The reference is the same model with a plain torch optimizer whose gradients are averaged by
hand exactly as DDP does (``grad * (1/N)``, then a SUM all-reduce): torch DDP itself registers
its hooks at construction and does not reduce a param that becomes trainable later. At world 2
the sum of two values does not depend on the order, so params and state are compared bit for
bit after every step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import captured_logs, world
from torch import nn

_STEPS = 7


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)


def _average(model: nn.Module) -> None:
    scale = 1.0 / dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
            dist.all_reduce(p.grad)


def _trainable_at(step: int, name: str) -> bool:
    """First layer frozen at construction, trainable from step 2; middle layer frozen for
    steps 3 and 4, then trainable again (its state must survive the frozen steps)."""
    if name.startswith("0."):
        return step >= 2
    if name.startswith("2."):
        return step not in (3, 4)
    return True


@pytest.mark.parametrize(
    ("optim", "kw", "master"),
    [
        (torch.optim.Adam, {"lr": 1e-2}, False),
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}, False),
        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, True),
    ],
    ids=["adam", "sgd_momentum_wd", "adamw_bf16_masters"],
)
@world(2, timeout=120)
def test_freeze_and_unfreeze_match_plain_optimizer(
    optim: type[torch.optim.Optimizer], kw: dict[str, Any], master: bool
) -> None:
    ref = _net()
    model = copy.deepcopy(ref)
    if master:
        ref, model = ref.to(torch.bfloat16), model.to(torch.bfloat16)
    for m in (ref, model):
        for n, p in m.named_parameters():
            p.requires_grad_(_trainable_at(0, n))
    ref_opt = optim(ref.parameters(), **kw)
    opt = ShardedOptimizer(
        model.parameters(), optim=optim, master_dtype=torch.float32 if master else None, **kw
    )
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=23)
    dtype = torch.bfloat16 if master else torch.float32
    with captured_logs("shardkit.ddp") as logs:
        for step in range(_STEPS):
            for m in (ref, model):
                for n, p in m.named_parameters():
                    p.requires_grad_(_trainable_at(step, n))
            x, y = (t.to(dtype) for t in _batch(step))
            nn.functional.mse_loss(ref(x), y).backward()
            _average(ref)
            ref_opt.step()  # bf16: the plain reference keeps no fp32 masters (compared below)
            ref_opt.zero_grad()
            nn.functional.mse_loss(sdp(x), y).backward()
            opt.step()
            opt.zero_grad()
            if not master:
                for (n, a), b in zip(ref.named_parameters(), sdp.parameters(), strict=True):
                    assert torch.equal(a, b), f"step {step} {n}: {(a - b).abs().max().item()}"
    assert len(logs.matching("bucket layout rebuilt")) == 3  # steps 2, 3 and 5
    have = sdp.optimizer_state_dict()["state"]
    want = ref_opt.state_dict()["state"]
    assert sorted(have) == sorted(want)
    if not master:
        for i, st in want.items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(have[i][k]), torch.as_tensor(v)), (i, k)
    else:  # step counts: the frozen middle layer skipped steps 3 and 4 on both sides
        for i, st in want.items():
            assert torch.equal(torch.as_tensor(have[i]["step"]), torch.as_tensor(st["step"])), i


@world(2, timeout=60)
def test_refresh_refuses_pending_gradients_and_unknown_params() -> None:
    model = _net()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=23, auto_refresh_trainable=False)
    x, y = _batch(0)
    nn.functional.mse_loss(sdp(x), y).backward()
    model[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"reduced gradients wait for optimizer\.step"):
        sdp.refresh_trainable()
    opt.zero_grad()
    sdp.refresh_trainable()  # now fine: the layout holds the other params only
    before = model[0].weight.detach().clone()
    nn.functional.mse_loss(sdp(x), y).backward()
    opt.step()
    assert torch.equal(model[0].weight, before)
    assert model[0].weight.grad is None
    # a param outside every optimizer cannot become trainable: its gradient would never move
    extra = nn.Linear(2, 2)
    model2 = nn.Sequential(_net(), extra)
    extra.requires_grad_(False)
    opt2 = ShardedOptimizer(model2[0].parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp2 = ShardedDataParallel(model2, opt2, reduce_buffer_size=23)
    extra.requires_grad_(True)
    with pytest.raises(ValueError, match="in no optimizer"):
        sdp2(torch.randn(3, 5))


@world(2, timeout=60)
def test_refresh_with_two_optimizers_keeps_each_state() -> None:
    """fairscale's ``ShardedDataParallel(model, [opt1, opt2])``: freezing a param of the second
    optimizer rebuilds both layouts and each optimizer keeps its own state."""
    ref = _net()
    model = copy.deepcopy(ref)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    ref_opts = [
        torch.optim.Adam(ref_params[:2], lr=1e-2),
        torch.optim.SGD(ref_params[2:], lr=0.05, momentum=0.9),
    ]
    opts = [
        ShardedOptimizer(params[:2], optim=torch.optim.Adam, lr=1e-2),
        ShardedOptimizer(params[2:], optim=torch.optim.SGD, lr=0.05, momentum=0.9),
    ]
    sdp = ShardedDataParallel(model, opts, reduce_buffer_size=23)
    for step in range(4):
        frozen = step in (1, 2)
        ref[2].weight.requires_grad_(not frozen)
        model[2].weight.requires_grad_(not frozen)
        x, y = _batch(step)
        nn.functional.mse_loss(ref(x), y).backward()
        _average(ref)
        nn.functional.mse_loss(sdp(x), y).backward()
        for o in (*ref_opts, *opts):
            o.step()
            o.zero_grad()
        for (n, a), b in zip(ref.named_parameters(), sdp.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step} {n}: {(a - b).abs().max().item()}"
    for k, ro in enumerate(ref_opts):
        have, want = sdp.optimizer_state_dict(k)["state"], ro.state_dict()["state"]
        assert sorted(have) == sorted(want), k
        for i, st in want.items():
            for key, v in st.items():
                assert torch.equal(torch.as_tensor(have[i][key]), torch.as_tensor(v)), (k, i, key)
