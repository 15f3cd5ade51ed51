"""Multi-rank Gloo tests: one collective on a flat bucket reduces every param's grad."""

from __future__ import annotations

import torch
import torch.distributed as dist
from shardkit.buckets import GradBucket, build_grad_buckets, plan_buckets
from shardkit.testing import world
from torch.nn.parallel import DistributedDataParallel as DDP


def _model(seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Linear(4, 1)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(7, 6, generator=torch.Generator().manual_seed(100 + rank))


@world(2)
def test_allreduce_one_flat_bucket_matches_ddp() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _model()
    params = list(model.parameters())
    bucket = GradBucket(sum(p.numel() for p in params), torch.float32, "cpu")
    for name, p in model.named_parameters():
        bucket.add_grad(p, name=name)

    for _ in range(2):  # two steps: zero_() keeps the views for the second
        bucket.zero_()
        model(_batch(rank)).square().sum().backward()
        assert bucket.attached
        dist.all_reduce(bucket.buffer)  # one collective for every grad
        bucket.buffer.div_(size)

    ref = DDP(_model(), bucket_cap_mb=25)
    ref(_batch(rank)).square().sum().backward()
    for (name, p), r in zip(model.named_parameters(), ref.module.parameters(), strict=True):
        assert p.grad is not None and r.grad is not None
        # world 2: dividing by 2 is exact, so the result is bit-for-bit DDP's.
        assert torch.equal(p.grad, r.grad), name
    # Both ranks hold the same reduced grads.
    gathered = [torch.empty_like(bucket.buffer) for _ in range(size)]
    dist.all_gather(gathered, bucket.buffer)
    assert torch.equal(gathered[0], gathered[1])


@world(2)
def test_reduce_planned_buckets_to_their_destination_then_collapse() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _model(1)
    named = list(model.named_parameters())
    plan = plan_buckets(named, cap_bytes=64, first_bucket_cap_bytes=32, alignment=4)
    fingerprints: list[str | None] = [None] * size
    dist.all_gather_object(fingerprints, plan.fingerprint())
    assert len(set(fingerprints)) == 1  # every rank planned the same layout
    assert len(plan) >= 3
    buckets = build_grad_buckets(named, plan, [i % size for i in range(len(plan))])

    model(_batch(rank)).sum().backward()
    # Per-param reference: the sum of every rank's grad.
    expected = [p.grad.clone() for _, p in named if p.grad is not None]
    for t in expected:
        dist.all_reduce(t)
    for bucket in buckets:
        assert bucket.destination is not None
        dist.reduce(bucket.buffer, dst=bucket.destination)
    for bucket in buckets:
        if bucket.destination != rank:
            bucket.collapse()  # this rank does not own these grads: free them
    for index, ((name, p), exp) in enumerate(zip(named, expected, strict=True)):
        owner = buckets[plan.bucket_of(index)[0]]
        if owner.destination == rank:
            assert p.grad is not None and torch.equal(p.grad, exp), name
        else:
            assert p.grad is None and owner.collapsed, name
    for bucket in buckets:
        was_collapsed = bucket.collapsed
        bucket.rebuild()  # a no-op on the owned buckets, which keep their reduced grads
        assert bucket.attached
        assert bool(torch.all(bucket.buffer == 0)) == was_collapsed


@world(2)
def test_overlapped_allreduce_launched_when_a_bucket_is_full() -> None:
    rank = dist.get_rank()
    model = _model(2)
    params = list(model.parameters())
    plan = plan_buckets(params, cap_bytes=48)
    buckets = build_grad_buckets(params, plan)
    works: list[tuple[int, dist.Work]] = []

    def hook(p: torch.Tensor) -> None:
        which = plan.bucket_of(_position(params, p))[0]
        bucket = buckets[which]
        if bucket.check_in(p):
            work = dist.all_reduce(bucket.buffer, async_op=True)
            assert work is not None
            works.append((which, work))

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    try:
        model(_batch(rank)).square().mean().backward()
    finally:
        for h in handles:
            h.remove()
    for _, work in works:
        work.wait()
    assert sorted(i for i, _ in works) == list(range(len(plan)))
    assert all(b.full for b in buckets)
    # Reference: a separate model, one all-reduce per param.
    ref = _model(2)
    ref(_batch(rank)).square().mean().backward()
    for p, r in zip(params, ref.parameters(), strict=True):
        assert r.grad is not None
        dist.all_reduce(r.grad)
        assert p.grad is not None and torch.equal(p.grad, r.grad)


def _position(params: list[torch.Tensor], p: torch.Tensor) -> int:
    for i, q in enumerate(params):
        if q is p:
            return i
    raise AssertionError("hook fired for an unknown param")
