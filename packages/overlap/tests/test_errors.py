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
from shardkit.overlap._torch_compat import GradBucket
from shardkit.testing import world
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
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
    with pytest.raises(TypeError, match=r"grad_scaler must be a torch\.amp\.GradScaler"):
        register_zero_overlap(ddp, zero, grad_scaler=object())
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        register_zero_overlap(ddp, zero, max_grad_norm=0.0)
    with pytest.raises(TypeError, match="max_grad_norm must be a number"):
        register_zero_overlap(ddp, zero, max_grad_norm="1")  # type: ignore[arg-type]
    _, ddp2, zero2 = _setup(broadcast_fp16=True)
    with pytest.raises(ValueError, match="broadcast_fp16"):
        register_zero_overlap(ddp2, zero2)
    net = _net()
    ddp3 = DDP(net)
    zero3 = ShardedOptimizer(net.parameters(), torch.optim.LBFGS, lr=0.1)
    with pytest.raises(ValueError, match="LBFGS"):
        register_zero_overlap(ddp3, zero3)
    # a disabled scaler is a no-op: the hooks keep stepping
    overlap = register_zero_overlap(ddp, zero, grad_scaler=ShardedGradScaler("cpu", enabled=False))
    assert not overlap.loop_step
    overlap.close()
    # an enabled scaler or clipping: accepted, the step moves to the loop
    _, ddp4, zero4 = _setup()
    overlap = register_zero_overlap(ddp4, zero4, grad_scaler=ShardedGradScaler("cpu"))
    assert overlap.loop_step
    overlap.close()


@world(2)
def test_no_double_step() -> None:
    _, ddp, zero = _setup()
    overlap = register_zero_overlap(ddp, zero, interleaved=False)
    try:
        with pytest.raises(RuntimeError, match="no backward pass with gradient synchronisation"):
            overlap.step()
        with pytest.raises(RuntimeError, match="no backward pass with gradient synchronisation"):
            zero.step()
        _train_step(ddp)
        assert overlap.stepped
        before = [p.detach().clone() for p in ddp.parameters()]
        with pytest.raises(RuntimeError, match="closure"):
            zero.step(lambda: 0.0)
        zero.step()  # the loop's step: consumes the hooks' update, changes nothing
        assert all(torch.equal(a, p) for a, p in zip(before, ddp.parameters(), strict=True))
        with pytest.raises(RuntimeError, match="no backward pass"):
            overlap.step()  # the update was consumed
        _train_step(ddp)
        overlap.step()  # same as zero.step()
        with pytest.raises(RuntimeError, match="no backward pass"):
            zero.step()
        with ddp.no_sync():
            _train_step(ddp)
        with pytest.raises(RuntimeError, match="no backward pass"):
            zero.step()
    finally:
        overlap.close()
    zero.step()  # close() restores the normal step


@world(2)
def test_reduce_to_owner_errors() -> None:
    _, ddp, zero = _setup()
    with pytest.raises(TypeError, match="reduce_to_owner must be a bool"):
        hook_with_zero_step(allreduce_hook, ddp, zero, reduce_to_owner=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only works with the default allreduce_hook"):
        hook_with_zero_step_interleaved(
            default_hooks.fp16_compress_hook, ddp, zero, reduce_to_owner=True
        )
    with pytest.raises(ValueError, match="cannot be combined with an enabled grad_scaler"):
        register_zero_overlap(ddp, zero, max_grad_norm=1.0, reduce_to_owner=True)
    scaler = ShardedGradScaler("cpu", group=zero.group)
    with pytest.raises(ValueError, match="cannot be combined with an enabled grad_scaler"):
        register_zero_overlap(ddp, zero, grad_scaler=scaler, reduce_to_owner=True)
    # ranks disagreeing raise on every rank, nothing left registered
    with pytest.raises(ValueError, match="ranks disagree on the overlap registration"):
        register_zero_overlap(ddp, zero, reduce_to_owner=dist.get_rank() == 0)
    overlap = register_zero_overlap(ddp, zero, reduce_to_owner=True)
    assert overlap.config.reduce_to_owner
    _train_step(ddp)
    overlap.step()
    overlap.close()


@world(2, timeout=90)
def test_one_rank_errors_raise_on_every_rank() -> None:
    """A local registration error on one rank only is raised, the same, on every rank (through
    one agreement collective), instead of leaving the other ranks waiting in the next collective
    for the process group's timeout. See [Note: Registration agreement]."""
    rank = dist.get_rank()
    _, ddp, zero = _setup()
    # A bad hook on rank 1 only: every rank raises rank 1's TypeError.
    with pytest.raises(TypeError, match=r"failed on rank 1 of 2.*comm hook"):
        hook_with_zero_step(42 if rank == 1 else allreduce_hook, ddp, zero)  # type: ignore[arg-type]
    # An unsupported option on rank 0 only.
    with pytest.raises(ValueError, match=r"failed on rank 0 of 2.*max_grad_norm must be positive"):
        register_zero_overlap(ddp, zero, max_grad_norm=0.0 if rank == 0 else None)
    # Another model's DDP on rank 1 only: its params are not the optimizer's.
    ddp_other = DDP(_net())
    with pytest.raises(ValueError, match=r"failed on rank 1 of 2.*not in the ShardedOptimizer"):
        hook_with_zero_step(allreduce_hook, ddp_other if rank == 1 else ddp, zero)
    # A hook already built on rank 1 only (rank 0 registers on a fresh pair).
    _, ddp_a, zero_a = _setup()
    first = register_zero_overlap(ddp_a, zero_a)
    _, ddp_b, zero_b = _setup()
    try:
        with pytest.raises(RuntimeError, match=r"failed on rank 1 of 2.*already built"):
            register_zero_overlap(ddp_b if rank == 0 else ddp_a, zero_b if rank == 0 else zero_a)
    finally:
        first.close()
    # Hyper-parameters changed on one rank since construction.
    zero.param_groups[0]["lr"] = 0.1 if rank == 0 else 0.2
    with pytest.raises(
        ValueError, match=r"hyper-parameters.*lr=0\.1 on rank 0 but lr=0\.2 on rank 1"
    ):
        register_zero_overlap(ddp, zero)
    zero.param_groups[0]["lr"] = 0.1
    # Nothing is left half-registered or out of step: a registration on every rank now works.
    overlap = register_zero_overlap(ddp, zero)
    _train_step(ddp)
    overlap.step()
    overlap.close()
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("hooked", [False, True])
@world(2, timeout=120)
def test_a_per_rank_learning_rate_is_refused_before_anything_moves(hooked: bool) -> None:
    """Issue 29: the agreement runs before any shard moves, also when the hooks step inside
    backward (ZeRO-1 under plain DDP when ``hooked`` is False)."""
    net = _net()
    ddp = DDP(net)
    zero = ShardedOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    overlap = register_zero_overlap(ddp, zero) if hooked else None
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    ddp(x).square().mean().backward()
    zero.step()
    zero.zero_grad()
    before = [p.detach().clone() for p in net.parameters()]
    zero.param_groups[0]["lr"] = 0.1 * (1 + dist.get_rank())  # a per-rank schedule
    with pytest.raises(ValueError, match="different hyper-parameters"):
        ddp(x).square().mean().backward()  # the hooks step inside backward
        zero.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    if overlap is not None:
        overlap.close()
