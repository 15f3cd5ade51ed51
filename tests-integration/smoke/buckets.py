"""Smoke test of shardkit-buckets installed alone: bucket plans and params as views of flat buffers."""

from __future__ import annotations

import copy

import torch
from shardkit.buckets import ParamBucket, plan_buckets
from torch import nn


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    named = [(n, p) for n, p in model.named_parameters()]
    plan = plan_buckets(named, cap_bytes=256)
    assert len(plan) >= 2, f"a 256-byte cap should give several buckets, got {len(plan)}"
    assert sorted(i for b in plan.bucket_indices for i in b) == list(range(len(named)))
    ref = copy.deepcopy(model)
    for spec in plan.buckets:  # one flat buffer per planned bucket, params as its views
        bucket = ParamBucket(spec.padded_numel, spec.dtype, spec.device)
        for i, off in zip(spec.indices, spec.offsets, strict=True):
            bucket.add_param(named[i][1])
            start = bucket.buffer.data_ptr() + off * bucket.buffer.element_size()
            assert named[i][1].data_ptr() == start, "a param is not where the plan puts it"
        bucket.buffer.mul_(2)  # one op on the buffer reaches every param of the bucket
    for (name, p), (_, q) in zip(named, ref.named_parameters(), strict=True):
        assert torch.equal(p, 2 * q), name

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
