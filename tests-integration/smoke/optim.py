"""Smoke test of shardkit-optim installed alone (no NumPy): ZeRO-1 AdamW on a world-1 group
steps exactly like plain AdamW, consolidates into a plain state dict, and the DCP checkpoint
functions say clearly that they need NumPy when it is absent."""

from __future__ import annotations

import copy
import importlib.util
import tempfile

import torch
import torch.distributed as dist
from shardkit.optim import ShardedGradScaler, ShardedOptimizer, load_sharded, save_sharded
from torch import nn


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        ref = copy.deepcopy(model)
        zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        plain = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            for m, opt in ((model, zero), (ref, plain)):
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p, q), f"step {step}: params differ from plain AdamW"
        zero.consolidate_state_dict(recipient_rank=0)
        fresh = torch.optim.AdamW(copy.deepcopy(ref).parameters(), lr=1e-2, weight_decay=0.1)
        fresh.load_state_dict(zero.state_dict())
        for a, b in zip(fresh.state.values(), plain.state.values(), strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b)
        assert ShardedGradScaler("cpu").is_enabled()

        with tempfile.TemporaryDirectory() as tmp:
            if importlib.util.find_spec("numpy") is None:
                try:
                    save_sharded(zero, f"{tmp}/ckpt")
                except RuntimeError as exc:
                    assert "NumPy" in str(exc), exc
                else:
                    raise AssertionError("save_sharded without NumPy did not raise")
            else:
                save_sharded(zero, f"{tmp}/ckpt")
                load_sharded(zero, f"{tmp}/ckpt")
    finally:
        dist.destroy_process_group()
    print("smoke ok: shardkit-optim")


if __name__ == "__main__":
    main()
