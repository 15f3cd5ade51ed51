"""Clipping, the grad scaler, sub groups, empty shards, frozen params, add_param_group, errors."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedGradScaler, ShardedOptimizer
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _loss(model: nn.Module, step: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    return nn.functional.mse_loss(model(x), y) * scale


def _train_pair(
    ref_model: nn.Module,
    ref: torch.optim.Optimizer,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    start: int = 0,
) -> None:
    for s in range(start, start + steps):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            _loss(m, s).backward()
            o.step()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@world(2)
def test_clip_grad_norm_matches_torch(norm_type: float) -> None:
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    for m in (ref_model, model):
        _loss(m, 0, scale=50.0).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5, norm_type)
    total = opt.clip_grad_norm(0.5, norm_type)
    # sharded sums are reduced in another order: equal to float32 rounding
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)
    # fp16 grads are reduced in fp32 (their fp16 norm would overflow here)
    half = copy.deepcopy(model).half()
    hopt = ShardedOptimizer(half.parameters(), optim=torch.optim.SGD, lr=0.1)
    for p in half.parameters():
        p.grad = torch.full_like(p, 300.0)
    hn = hopt.clip_grad_norm(1e9, norm_type)
    n_el = sum(p.numel() for p in half.parameters())
    exp_h = 300.0 if math.isinf(norm_type) else 300.0 * n_el ** (1 / norm_type)
    assert hn.dtype == torch.float32 and math.isclose(hn.item(), exp_h, rel_tol=1e-5)
    # filter: only the first layer
    first = list(model.parameters())[:2]
    n = opt.clip_grad_norm(
        1e9, 2.0, filter_params_fn=lambda ps: [p for p in ps if any(p is f for f in first)]
    )
    exp = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in first])
    )  # type: ignore[union-attr]
    torch.testing.assert_close(n, exp, rtol=1e-6, atol=0)


def test_collective_device_per_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gloo reduces CPU and CUDA tensors where they are (the clip norm then stays on the grads'
    device, as with torch's clip_grad_norm_); NCCL only CUDA ones. Found on a GPU: the norm of
    CUDA grads over Gloo came back on the CPU."""
    from shardkit.optim import _dist

    for backend, cpu, cuda in (("gloo", True, True), ("nccl", False, True)):
        monkeypatch.setattr(_dist.dist, "get_backend", lambda group=None, b=backend: b)
        assert _dist._reduces_on(None, torch.device("cpu")) is cpu  # type: ignore[arg-type]
        assert _dist._reduces_on(None, torch.device("cuda", 0)) is cuda  # type: ignore[arg-type]
        assert _dist._reduces_on(None, torch.device("meta")) is False  # type: ignore[arg-type]


@world(2)
def test_clip_norm_lives_where_the_grads_do() -> None:
    """Also on a rank that owns no gradient (a frozen shard)."""
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    _loss(model, 0).backward()
    for p in opt.owned_params if dist.get_rank() == 1 else []:
        p.grad = None
    norm = opt.clip_grad_norm(1.0)
    assert norm.device == next(model.parameters()).device and norm.dtype == torch.float32


@world(2)
def test_grad_scaler_skips_on_every_rank() -> None:
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ddp = DDP(model)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    scaler = ShardedGradScaler("cpu", init_scale=4.0, group=opt.group)
    before = [p.detach().clone() for p in model.parameters()]
    # rank 1 alone sees an inf in a gradient after the reduction (e.g. a hook on one rank)
    opt.zero_grad()
    scaler.scale(_loss(ddp, 0)).backward()
    if dist.get_rank() == 1:
        next(iter(model.parameters())).grad[0, 0] = math.inf  # type: ignore[index]
    scaler.step(opt)
    scaler.update()
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)  # both ranks skipped: no divergence
    assert scaler.get_scale() == 2.0
    # a finite step matches a plain GradScaler + Adam run
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    for m, o, s in ((ddp, opt, scaler), (ref_model, ref_opt, ref_scaler)):
        o.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(m, 1)
        s.scale(loss).backward()
        s.step(o)
        s.update()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@world(3)
def test_sub_group_ranks_are_translated() -> None:
    sub = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, group=sub, lr=0.01)
    assert opt.rank == dist.get_rank() - 1 and opt.world_size == 2
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    _train_pair(ref_model, ref, model, opt, 2)
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    opt.consolidate_state_dict(recipient_rank=1)  # group rank 1 == global rank 2
    if dist.get_rank() == 2:
        sd = opt.state_dict()
        assert torch.equal(sd["state"][0]["exp_avg"], ref.state_dict()["state"][0]["exp_avg"])
    clipped = opt.clip_grad_norm(1.0)
    assert clipped.item() > 0


@world(4)
def test_empty_shards_more_ranks_than_params() -> None:
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(4, 2))  # two params, four ranks
    model = copy.deepcopy(ref_model)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    assert len(opt.owned_params) == (1 if dist.get_rank() < 2 else 0)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.1)
    _train_pair(ref_model, ref, model, opt, 2)
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    opt.consolidate_state_dict(recipient_rank=3)
    if dist.get_rank() == 3:
        assert sorted(opt.state_dict()["state"]) == [0, 1]


@world(2)
def test_refresh_trainable_and_add_param_group() -> None:
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ps, ref_ps = list(model.parameters()), list(ref_model.parameters())
    for p in (ps[0], ps[1], ref_ps[0], ref_ps[1]):
        p.requires_grad_(False)
    opt = ShardedOptimizer(ps, optim=torch.optim.Adam, lr=0.01)
    ref = torch.optim.Adam(ref_ps, lr=0.01)
    _train_pair(ref_model, ref, model, opt, 2)
    for p in (ps[0], ps[1], ref_ps[0], ref_ps[1]):
        p.requires_grad_(True)
    opt.refresh_trainable()
    _train_pair(ref_model, ref, model, opt, 2, start=2)
    for a, b in zip(ref_ps, ps, strict=True):
        assert torch.equal(a, b)
    # freezing without refresh_trainable(): step repartitions (with a warning) and stays exact
    ps[4].requires_grad_(False)
    ref_ps[4].requires_grad_(False)
    with pytest.warns(UserWarning, match="refresh_trainable"):
        _train_pair(ref_model, ref, model, opt, 1, start=4)
    # add_param_group after training started; state of existing params moves with them
    extra, ref_extra = nn.Linear(2, 2), nn.Linear(2, 2)
    ref_extra.load_state_dict(extra.state_dict())
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.1})
    ref.add_param_group({"params": list(ref_extra.parameters()), "lr": 0.1})
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)
    for s in range(5, 7):
        for m, e, o in ((ref_model, ref_extra, ref), (model, extra, opt)):
            o.zero_grad()
            (_loss(m, s) + e(torch.ones(1, 2)).sum()).backward()
            o.step()
    for a, b in zip([*ref_ps, *ref_extra.parameters()], [*ps, *extra.parameters()], strict=True):
        assert torch.equal(a, b)
    opt.consolidate_state_dict(recipient_rank=0)
    if dist.get_rank() == 0:
        sd, rsd = opt.state_dict(), ref.state_dict()
        assert sd["param_groups"] == rsd["param_groups"]
        for i, st in rsd["state"].items():
            assert torch.equal(sd["state"][i]["exp_avg_sq"], st["exp_avg_sq"])


@world(2)
def test_user_errors() -> None:
    model = _model()
    with pytest.raises(TypeError, match="Optimizer subclass"):
        ShardedOptimizer(model.parameters(), optim=torch.optim.Adam(model.parameters()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Optimizer subclass"):
        ShardedOptimizer(model.parameters(), optim=dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="partition_algorithm"):
        ShardedOptimizer(model.parameters(), partition_algorithm="random", lr=0.1)
    with pytest.raises(TypeError, match="ProcessGroup"):
        ShardedOptimizer(model.parameters(), group="world", lr=0.1)  # type: ignore[arg-type]
    emb = nn.Embedding(10, 3, sparse=True)
    opt = ShardedOptimizer(emb.parameters(), optim=torch.optim.SGD, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradient"):
        opt.step()


@world(2)
def test_params_mismatch_between_ranks_raises_everywhere() -> None:
    width = 8 if dist.get_rank() == 0 else 9
    model = nn.Linear(4, width)
    with pytest.raises(ValueError):
        ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    # different param-group layouts too
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ps = list(model.parameters())
    groups: Any = (
        [{"params": ps[:2]}, {"params": ps[2:]}] if dist.get_rank() == 0 else [{"params": ps}]
    )
    with pytest.raises(ValueError, match="disagree"):
        ShardedOptimizer(groups, optim=torch.optim.SGD, lr=0.1)
