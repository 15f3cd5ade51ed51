"""Smoke test of shardkit-buckets installed alone: grads and params as views of flat buffers."""

from __future__ import annotations

import copy

import torch
from shardkit.buckets import ParamBucket, build_grad_buckets, plan_buckets
from torch import nn


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    named = [(n, p) for n, p in model.named_parameters()]
    plan = plan_buckets(named, cap_bytes=256)
    assert len(plan) >= 2, f"a 256-byte cap should give several buckets, got {len(plan)}"
    assert sorted(i for b in plan.bucket_indices for i in b) == list(range(len(named)))
    buckets = build_grad_buckets(named, plan)
    for b in buckets:
        b.zero_()
    x = torch.randn(5, 8)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), (_, q) in zip(named, ref.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for b in buckets:
        start = b.buffer.data_ptr()
        end = start + b.buffer.numel() * b.buffer.element_size()
        for p in b.params:
            assert start <= p.grad.data_ptr() < end, "a grad is not a view of its bucket"
        b.buffer.mul_(2)  # one op on the buffer reaches every grad
    for (name, p), (_, q) in zip(named, ref.named_parameters(), strict=True):
        assert torch.equal(p.grad, 2 * q.grad), name

    weights = [p.detach().clone() for p in model.parameters()]
    bucket = ParamBucket(
        sum(p.numel() for p in model.parameters()), torch.float32, torch.device("cpu")
    )
    for p in model.parameters():
        bucket.add_param(p)
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p, w), "add_param changed a value"
    bucket.buffer.zero_()
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())
    print("smoke ok: shardkit-buckets")


if __name__ == "__main__":
    main()
