"""Smoke test of shardkit-overlap installed alone (no NumPy): the overlap hook steps a
ShardedOptimizer inside DDP's backward on a world-1 group, exactly like plain DDP + AdamW."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer
from shardkit.overlap import register_zero_overlap
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        ref_model = copy.deepcopy(model)
        ddp, ref = DDP(model, bucket_cap_mb=0.0005), DDP(ref_model, bucket_cap_mb=0.0005)
        zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        plain = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
        overlap = register_zero_overlap(ddp, zero)
        try:
            for step in range(3):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                ddp(x).square().mean().backward()
                assert overlap.stepped
                overlap.step()
                zero.zero_grad()
                ref(x).square().mean().backward()
                plain.step()
                plain.zero_grad()
                for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                    assert torch.equal(p, q), f"step {step}: params differ from plain DDP"
        finally:
            overlap.close()
    finally:
        dist.destroy_process_group()
    print("smoke ok: shardkit-overlap")


if __name__ == "__main__":
    main()
