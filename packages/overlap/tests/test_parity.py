"""Overlap hooks vs plain DDP + the plain torch optimizer: per-step param parity from step 1.

Tolerance: every comparison uses ``torch.testing.assert_close(rtol=1e-6, atol=1e-7)``. The
reference DDP reduces with the same comm hook, so the reduced gradients are bitwise equal and
the optimizers run the same elementwise math; the tolerance only absorbs foreach-vs-subset
kernel grouping, which has been exact in practice.

``reduce_to_owner=True`` replaces the all-reduce by reduces of the same pre-divided addends to
the owners: bitwise equal at world 2 (a + b), possibly the last bit apart at world 3 (the
backend's reduce may sum in another order than its all-reduce). The same tolerance applies
(a last-bit gradient difference moves an SGD/Adam update by ~1e-7 relative, far below it).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer
from shardkit.overlap import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    register_zero_overlap,
)
from shardkit.testing import rank_cuda_device, world
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

RTOL, ATOL = 1e-6, 1e-7
STEPS = 4


class _Net(nn.Module):
    def __init__(self, frozen: bool = False, branch: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 8)
        self.head = nn.Linear(8, 2)
        self.other = nn.Linear(8, 2) if branch else None
        self.never = nn.Linear(8, 2) if branch else None
        if frozen:
            self.b.requires_grad_(False)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        h = torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))
        if self.other is not None and step % 2 == 1:
            return self.other(h)
        return self.head(h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def _groups(model: nn.Module, two_groups: bool) -> Any:
    params = [p for p in model.parameters()]
    if not two_groups:
        return params
    return [{"params": params[:4], "lr": 0.02}, {"params": params[4:], "lr": 0.005}]


_OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
}


def _run(
    *,
    optim: str = "adam",
    interleaved: bool = True,
    shard_buckets: bool = False,
    static_graph: bool = False,
    bucket_view: bool = False,
    two_groups: bool = False,
    frozen: bool = False,
    branch: bool = False,
    hook: Any = default_hooks.allreduce_hook,
    group: dist.ProcessGroup | None = None,
    steps: int = STEPS,
    device: str = "cpu",
    reduce_to_owner: bool = False,
    accumulate: bool = False,
) -> None:
    cls, kw = _OPTIMS[optim]
    net = _Net(frozen=frozen, branch=branch).to(device)
    ref_net = copy.deepcopy(net)
    ddp_kw: dict[str, Any] = dict(
        bucket_cap_mb=0.0006,  # ~600 bytes: several buckets once DDP rebuilds them
        static_graph=static_graph,
        gradient_as_bucket_view=bucket_view,
        find_unused_parameters=branch,
        process_group=group,
    )
    ddp = DDP(net, **ddp_kw)
    ref = DDP(ref_net, **ddp_kw)
    ref.register_comm_hook(group, hook)
    zero = ShardedOptimizer(_groups(net, two_groups), cls, group=group, **kw)
    ref_opt = cls(_groups(ref_net, two_groups), **kw)
    build = hook_with_zero_step_interleaved if interleaved else hook_with_zero_step
    overlap = build(hook, ddp, zero, shard_buckets=shard_buckets, reduce_to_owner=reduce_to_owner)
    ddp.register_comm_hook(group, overlap)
    owned = {id(p) for p in zero.owned_params}
    try:
        for step in range(steps):
            if accumulate:  # a local no_sync() backward first: grads accumulate unreduced
                xa, ya = (t.to(device) for t in _batch(step + 50))
                with ddp.no_sync(), ref.no_sync():
                    nn.functional.mse_loss(ddp(xa, step), ya).backward()
                    nn.functional.mse_loss(ref(xa, step), ya).backward()
            x, y = (t.to(device) for t in _batch(step))
            nn.functional.mse_loss(ddp(x, step), y).backward()
            nn.functional.mse_loss(ref(x, step), y).backward()
            if reduce_to_owner:
                # owned grads: DDP's average; non-owned: zeros (see [Note: Reduce to owner])
                for p, q in zip(net.parameters(), ref_net.parameters(), strict=True):
                    if p.grad is None or q.grad is None:
                        assert p.grad is None and q.grad is None
                    elif id(p) in owned:
                        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
                    else:
                        assert not p.grad.any()
            overlap.step()
            ref_opt.step()
            zero.zero_grad()
            ref_opt.zero_grad()
            for (name, p), q in zip(net.named_parameters(), ref_net.parameters(), strict=True):
                torch.testing.assert_close(
                    p, q, rtol=RTOL, atol=ATOL, msg=lambda m, n=name, s=step: f"step {s + 1} {n}: {m}"
                )
            if step == 0:
                # The update of the very first iteration is applied (no warm-up iterations).
                assert any(
                    not torch.equal(p, q)
                    for p, q in zip(
                        net.parameters(), _Net(frozen, branch).to(device).parameters(), strict=True
                    )
                )
    finally:
        overlap.close()


@world(2)
@pytest.mark.parametrize("optim", sorted(_OPTIMS))
@pytest.mark.parametrize("interleaved", [True, False])
def test_optimizers(optim: str, interleaved: bool) -> None:
    _run(optim=optim, interleaved=interleaved)


@world(2)
@pytest.mark.parametrize("static_graph", [True, False])
@pytest.mark.parametrize("bucket_view", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_ddp_modes(static_graph: bool, bucket_view: bool, interleaved: bool) -> None:
    _run(
        static_graph=static_graph, bucket_view=bucket_view, interleaved=interleaved,
        shard_buckets=static_graph, steps=5,
    )


@world(3)
@pytest.mark.parametrize("shard_buckets", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_world3_param_groups_frozen(shard_buckets: bool, interleaved: bool) -> None:
    _run(
        optim="adamw", interleaved=interleaved, shard_buckets=shard_buckets, two_groups=True,
        frozen=True,
    )


@world(2)
@pytest.mark.parametrize("interleaved", [True, False])
def test_unused_params(interleaved: bool) -> None:
    _run(optim="adam", branch=True, interleaved=interleaved, steps=4)


@world(2)
def test_fp16_compress_hook() -> None:
    _run(optim="sgd", hook=default_hooks.fp16_compress_hook)


@world(3)
@pytest.mark.parametrize("interleaved", [True, False])
def test_sub_group(interleaved: bool) -> None:
    """A group of global ranks {1, 2} of a world of 3: owners are group ranks, src global."""
    group = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return
    _run(group=group, interleaved=interleaved, shard_buckets=True)


@world(2)
@pytest.mark.parametrize("optim", ["sgd", "adam"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_reduce_to_owner(optim: str, interleaved: bool) -> None:
    _run(optim=optim, interleaved=interleaved, shard_buckets=interleaved, reduce_to_owner=True)


@world(2)
@pytest.mark.parametrize("static_graph", [True, False])
@pytest.mark.parametrize("bucket_view", [True, False])
def test_reduce_to_owner_ddp_modes(static_graph: bool, bucket_view: bool) -> None:
    _run(
        static_graph=static_graph, bucket_view=bucket_view, interleaved=not bucket_view,
        shard_buckets=static_graph, steps=5, reduce_to_owner=True,
    )


@world(2)
@pytest.mark.parametrize("reduce_to_owner", [True, False])
def test_no_sync_accumulation(reduce_to_owner: bool) -> None:
    _run(optim="sgd", reduce_to_owner=reduce_to_owner, accumulate=True)


@world(3)
@pytest.mark.parametrize("optim", ["sgd", "adam"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_reduce_to_owner_world3(optim: str, interleaved: bool) -> None:
    _run(
        optim=optim, interleaved=interleaved, shard_buckets=not interleaved, two_groups=True,
        frozen=True, reduce_to_owner=True,
    )


@world(2)
@pytest.mark.parametrize("interleaved", [True, False])
def test_reduce_to_owner_unused_params(interleaved: bool) -> None:
    _run(optim="adam", branch=True, interleaved=interleaved, reduce_to_owner=True)


@world(3)
@pytest.mark.parametrize("interleaved", [True, False])
def test_reduce_to_owner_sub_group(interleaved: bool) -> None:
    """Ranks {1, 2} of 3: ``dst`` of the reduces must be global ranks."""
    group = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return
    _run(group=group, interleaved=interleaved, shard_buckets=True, reduce_to_owner=True)


def _count_traffic(reduce_to_owner: bool) -> dict[str, list[int]]:
    """Per collective kind, the numel of every call in backward steps 2-3 (rebuilt buckets)."""
    net = _Net()
    ddp = DDP(net, bucket_cap_mb=0.0006)
    zero = ShardedOptimizer(net.parameters(), torch.optim.Adam, lr=0.01)
    overlap = register_zero_overlap(
        ddp, zero, shard_buckets=True, reduce_to_owner=reduce_to_owner
    )
    seen: dict[str, list[int]] = {"all_reduce": [], "reduce": [], "broadcast": []}
    originals = {name: getattr(dist, name) for name in seen}

    def counting(name: str) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.is_floating_point():  # the gradients and params only
                seen[name].append(tensor.numel())
            return originals[name](tensor, *args, **kwargs)

        return call

    try:
        for step in range(3):
            if step == 1:
                for name in seen:
                    setattr(dist, name, counting(name))
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            overlap.step()
            zero.zero_grad()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        overlap.close()
    return seen


@world(2)
def test_reduce_to_owner_moves_two_thirds_of_the_bytes() -> None:
    """All-reduce (~2x the bytes: reduce-scatter + all-gather) + broadcast = 3x the gradient
    bytes; reduce (1x) + broadcast = 2x, with no all-reduce at all."""
    n = sum(p.numel() for p in _Net().parameters()) * 2  # two counted steps
    plain = _count_traffic(reduce_to_owner=False)
    owner = _count_traffic(reduce_to_owner=True)
    assert sum(plain["all_reduce"]) == n and not plain["reduce"]
    assert sum(plain["broadcast"]) == n
    assert sum(owner["reduce"]) == n and not owner["all_reduce"]
    assert sum(owner["broadcast"]) == n
    wire_plain = 2 * sum(plain["all_reduce"]) + sum(plain["broadcast"])
    wire_owner = sum(owner["reduce"]) + sum(owner["broadcast"])
    assert (wire_plain, wire_owner) == (3 * n, 2 * n)
    # one reduce per run of same-owner params in bucket order (DDP's gradient-ready order may
    # interleave owners where the flat buffers keep them together: a few more reduces than
    # broadcasts, never more bytes)
    assert len(plain["broadcast"]) <= len(owner["reduce"]) <= 2 * len(plain["broadcast"])


_SEEN: list[int] = []


def _counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    _SEEN.append(bucket.index())
    return default_hooks.allreduce_hook(state, bucket)


@world(2)
def test_register_helper_and_generic_optimizer() -> None:
    """register_zero_overlap with the default hook and an optimizer outside the tested list."""
    net = _Net()
    ref_net = copy.deepcopy(net)
    ddp = DDP(net, bucket_cap_mb=0.0006)
    ref = DDP(ref_net, bucket_cap_mb=0.0006)
    ref.register_comm_hook(None, default_hooks.allreduce_hook)
    zero = ShardedOptimizer(net.parameters(), torch.optim.NAdam, lr=0.01)
    ref_opt = torch.optim.NAdam(ref_net.parameters(), lr=0.01)
    overlap = register_zero_overlap(ddp, zero, _counting_hook, shard_buckets=True)
    try:
        for step in range(3):
            _SEEN.clear()
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            nn.functional.mse_loss(ref(x), y).backward()
            assert overlap.stepped
            if step > 0:  # DDP rebuilt its buckets: the test really covers several of them
                assert _SEEN == list(range(len(_SEEN))) and len(_SEEN) >= 3, _SEEN
            overlap.step()
            ref_opt.step()
            for p, q in zip(net.parameters(), ref_net.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
            # the reduced gradients are where plain DDP leaves them
            for p, q in zip(net.parameters(), ref_net.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
            zero.zero_grad()
            ref_opt.zero_grad()
    finally:
        overlap.close()


@world(2, backend="nccl")
@pytest.mark.parametrize("interleaved", [True, False])
def test_nccl(interleaved: bool) -> None:
    """Same parity on NCCL (skipped without 2 GPUs)."""
    _run(optim="adam", interleaved=interleaved, bucket_view=True, device=str(rank_cuda_device()))


@world(1, backend="nccl")
@pytest.mark.parametrize("interleaved", [True, False])
def test_nccl_world1(interleaved: bool) -> None:
    """NCCL at world size 1: the hooks' CUDA path with a real NCCL group (skipped without a GPU)."""
    _run(optim="adam", interleaved=interleaved, bucket_view=True, device=str(rank_cuda_device()))


@pytest.mark.cuda
@world(2)
@pytest.mark.parametrize(
    ("interleaved", "reduce_to_owner"), [(True, False), (False, False), (True, True)]
)
def test_gloo_ranks_sharing_a_gpu(interleaved: bool, reduce_to_owner: bool) -> None:
    """Multi-rank CUDA path: two Gloo ranks on one GPU (skipped without a GPU)."""
    _run(
        optim="adamw",
        interleaved=interleaved,
        bucket_view=True,
        device=str(rank_cuda_device()),
        reduce_to_owner=reduce_to_owner,
    )
