"""Smoke test of shardkit-offload installed alone: an nn.Sequential run slice by slice from host
memory gives the plain model's outputs, gradients and AdamW step bit for bit."""

from __future__ import annotations

import copy

import torch
from shardkit.offload import OffloadModel, balanced_slices, module_bytes
from torch import nn


def main() -> None:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)]
    plain = nn.Sequential(*copy.deepcopy(layers))
    model = OffloadModel(
        nn.Sequential(*layers), device="cpu", num_slices=2, checkpoint_activation=True
    )
    assert [len(r) for r in model.slice_ranges] == [2, 2], model.slice_ranges
    assert module_bytes(plain) == sum(p.numel() * 4 for p in plain.parameters())
    assert balanced_slices([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        out, ref_out = model(x), plain(x)
        assert torch.equal(out, ref_out), f"step {step}: outputs differ"
        out.square().mean().backward()
        ref_out.square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (k, v), (k2, v2) in zip(
        model.state_dict().items(), plain.state_dict().items(), strict=True
    ):
        assert k == f"module.{k2}" and torch.equal(v, v2), (k, k2)
    print("smoke ok: shardkit-offload")


if __name__ == "__main__":
    main()
