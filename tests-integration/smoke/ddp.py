"""Smoke test of shardkit-ddp installed alone (with its siblings buckets, partition, optim):
ShardedDataParallel at world 1 trains like the plain model + AdamW, bit for bit, and counts its
collectives."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from torch import nn


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        model = copy.deepcopy(plain)
        ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
        ddp = ShardedDataParallel(model, opt, reduce_buffer_size=64)
        for step in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            for m, o in ((plain, ref_opt), (ddp, opt)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        for a, b in zip(plain.parameters(), ddp.parameters(), strict=True):  # waits for gathers
            assert torch.equal(a, b), "ShardedDataParallel differs from the plain model"
        calls = ddp.comm_stats.calls
        assert calls["reduce_scatter"] == calls["all_gather"] > 0, dict(calls)
        sd = opt.state_dict(all_ranks=True)
        assert sorted(sd["state"]) == sorted(ref_opt.state_dict()["state"])
    finally:
        dist.destroy_process_group()
    print("smoke ok: shardkit-ddp")


if __name__ == "__main__":
    main()
