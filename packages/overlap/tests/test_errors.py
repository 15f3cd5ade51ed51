"""Registration errors, loop misuse and the private torch/optim behaviour this package pins."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedGradScaler, ShardedOptimizer
from shardkit.overlap import (
    OverlapConfig,
    ZeroOverlap,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    register_zero_overlap,
)
from shardkit.overlap._ownership import _apply_owners
from shardkit.overlap._torch_compat import GradBucket, _queue_backward_callback
from shardkit.testing import world
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _setup(**zero_kw: Any) -> tuple[nn.Module, DDP, ShardedOptimizer]:
    net = _net()
    ddp = DDP(net, bucket_cap_mb=0.0002)
    zero = ShardedOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, **zero_kw)
    return net, ddp, zero


def _train_step(ddp: DDP) -> None:
    g = torch.Generator().manual_seed(dist.get_rank())
    ddp(torch.randn(3, 4, generator=g)).sum().backward()


def test_config_is_frozen() -> None:
    cfg = OverlapConfig()
    with pytest.raises(AttributeError):
        cfg.interleaved = False  # type: ignore[misc]


def test_grad_bucket_is_torch_class() -> None:
    assert GradBucket is dist.GradBucket


def test_queue_callback_runs_after_backward() -> None:
    order: list[str] = []
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()

    def hook(grad: torch.Tensor) -> None:
        _queue_backward_callback(lambda: order.append("callback"))
        order.append("hook")

    x.register_hook(hook)
    y.backward()
    assert order == ["hook", "callback"]


@world(2)
def test_bad_types() -> None:
    _, ddp, zero = _setup()
    with pytest.raises(TypeError, match="comm hook"):
        hook_with_zero_step(42, ddp, zero)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        hook_with_zero_step(allreduce_hook, _net(), zero)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ShardedOptimizer"):
        hook_with_zero_step(allreduce_hook, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shard_buckets must be a bool"):
        hook_with_zero_step(allreduce_hook, ddp, zero, shard_buckets="yes")  # type: ignore[arg-type]


@world(2)
def test_params_mismatch() -> None:
    net = _net()
    ddp = DDP(net)
    params = list(net.parameters())
    zero = ShardedOptimizer(params[:-1], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="not in the ShardedOptimizer"):
        hook_with_zero_step_interleaved(allreduce_hook, ddp, zero)
    extra = nn.Linear(2, 2)
    zero2 = ShardedOptimizer([*params, *extra.parameters()], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="not reduced by this DDP"):
        hook_with_zero_step_interleaved(allreduce_hook, ddp, zero2)


@world(3)
def test_different_process_group() -> None:
    sub = dist.new_group([0, 1])
    net = _net()
    ddp = DDP(net)
    if dist.get_rank() == 2:
        return
    zero = ShardedOptimizer(net.parameters(), torch.optim.SGD, group=sub, lr=0.1)
    with pytest.raises(ValueError, match="same ranks"):
        hook_with_zero_step(allreduce_hook, ddp, zero)


@world(2)
def test_register_twice() -> None:
    _, ddp, zero = _setup()
    overlap = register_zero_overlap(ddp, zero)
    try:
        with pytest.raises(RuntimeError, match="already built"):
            register_zero_overlap(ddp, zero)
        with pytest.raises(RuntimeError, match="already built"):
            hook_with_zero_step(allreduce_hook, ddp, zero)
    finally:
        overlap.close()


@world(2)
def test_ranks_disagree_raise_everywhere() -> None:
    _, ddp, zero = _setup()
    with pytest.raises(ValueError, match="ranks disagree on the overlap registration"):
        ZeroOverlap(allreduce_hook, ddp, zero, OverlapConfig(interleaved=dist.get_rank() == 0))


@world(2)
def test_unsupported_combinations() -> None:
    _, ddp, zero = _setup()
    scaler = ShardedGradScaler("cpu")
    with pytest.raises(ValueError, match="gradient scaler"):
        register_zero_overlap(ddp, zero, grad_scaler=scaler)
    with pytest.raises(ValueError, match="max_grad_norm"):
        register_zero_overlap(ddp, zero, max_grad_norm=1.0)
    _, ddp2, zero2 = _setup(broadcast_fp16=True)
    with pytest.raises(ValueError, match="broadcast_fp16"):
        register_zero_overlap(ddp2, zero2)
    # a disabled scaler is a no-op: accepted
    overlap = register_zero_overlap(ddp, zero, grad_scaler=ShardedGradScaler("cpu", enabled=False))
    overlap.close()


@world(2)
def test_no_double_step() -> None:
    _, ddp, zero = _setup()
    overlap = register_zero_overlap(ddp, zero, interleaved=False)
    try:
        with pytest.raises(RuntimeError, match="no backward pass with gradient synchronisation"):
            overlap.step()
        _train_step(ddp)
        before = [p.detach().clone() for p in ddp.parameters()]
        with pytest.raises(RuntimeError, match="already stepped"):
            zero.step()
        assert all(torch.equal(a, p) for a, p in zip(before, ddp.parameters(), strict=True))
        overlap.step()
        with pytest.raises(RuntimeError, match="no backward pass"):
            overlap.step()
        with ddp.no_sync():
            _train_step(ddp)
        with pytest.raises(RuntimeError, match="no backward pass"):
            overlap.step()
    finally:
        overlap.close()
    zero.step()  # released by close()


@world(2)
def test_apply_owners_pins_optim_repartition() -> None:
    """The optim workaround: an imposed owner map is used and existing state moves with it."""
    net, ddp, _ = _setup()
    zero2 = ShardedOptimizer(net.parameters(), torch.optim.Adam, lr=0.1)
    _train_step(ddp)
    zero2.step()
    before = zero2.state_dict(all_ranks=True)
    n = len(list(net.parameters()))
    owners = tuple((i + 1) % 2 for i in range(n))
    _apply_owners(zero2, owners)
    assert tuple(zero2._layout.owner) == owners
    assert {id(p) for p in zero2.owned_params} == {
        id(p) for i, p in enumerate(net.parameters()) if owners[i] == dist.get_rank()
    }
    after = zero2.state_dict(all_ranks=True)
    for i, st in before["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(after["state"][i][k], v, rtol=0, atol=0)
