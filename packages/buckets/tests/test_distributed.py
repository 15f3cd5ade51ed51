"""Multi-rank Gloo tests: one collective on a flat ParamBucket syncs every param in it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from shardkit.buckets import ParamBucket, plan_buckets
from shardkit.testing import world


def _model(seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Linear(4, 1)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


@world(2)
def test_one_broadcast_of_a_flat_param_bucket_syncs_every_param() -> None:
    rank = dist.get_rank()
    model = _model(seed=rank)  # different values on every rank
    params = list(model.parameters())
    bucket = ParamBucket(sum(p.numel() for p in params), torch.float32, "cpu")
    for name, p in model.named_parameters():
        bucket.add_param(p, name=name)
    dist.broadcast(bucket.buffer, src=0)  # one collective for every param
    assert bucket.attached
    for p, ref in zip(params, _model(seed=0).parameters(), strict=True):
        assert torch.equal(p.detach(), ref.detach())


@world(2)
def test_planned_param_buckets_broadcast_from_their_owner() -> None:
    """Buckets laid out by plan_buckets, each broadcast from one owner rank (as shardkit-optim
    syncs params after the step): every param ends equal to its owner's value."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _model(seed=10 + rank)
    named = list(model.named_parameters())
    plan = plan_buckets(named, cap_bytes=64, first_bucket_cap_bytes=32, alignment=4)
    assert len(plan) > size
    buckets = []
    for spec in plan.buckets:
        bucket = ParamBucket(spec.numel, spec.dtype, spec.device, alignment=plan.alignment)
        for i in spec.indices:
            bucket.add_param(named[i][1], name=named[i][0])
        buckets.append(bucket)
    for b, bucket in enumerate(buckets):
        dist.broadcast(bucket.buffer, src=b % size)
    refs = [list(_model(seed=10 + r).parameters()) for r in range(size)]
    for b, spec in enumerate(plan.buckets):
        for i in spec.indices:
            assert torch.equal(named[i][1].detach(), refs[b % size][i].detach()), named[i][0]
