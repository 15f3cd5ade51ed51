"""NCCL/CUDA variants: skipped with a reason without 2 GPUs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedGradScaler, ShardedOptimizer
from shardkit.testing import world
from torch import nn


@pytest.mark.nccl
@world(2, backend="nccl")
def test_nccl_step_consolidate_and_scaler() -> None:
    torch.cuda.set_device(dist.get_rank())
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).cuda()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    scaler = ShardedGradScaler("cuda", group=opt.group)
    for s in range(2):
        g = torch.Generator(device="cuda").manual_seed(s)
        x = torch.randn(6, 4, device="cuda", generator=g)
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            if o is opt:
                scaler.scale(m(x).square().mean()).backward()
                scaler.step(o)
                scaler.update()
            else:
                m(x).square().mean().backward()
                o.step()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # scaling by a power of two is exact; kernels may differ
    opt.consolidate_state_dict(recipient_rank=1)
    if dist.get_rank() == 1:
        sd = opt.state_dict()
        for i, st in ref.state_dict()["state"].items():
            assert sd["state"][i]["exp_avg"].device.type == "cpu"
            torch.testing.assert_close(sd["state"][i]["exp_avg"], st["exp_avg"].cpu())
    assert opt.clip_grad_norm(1.0).device.type == "cuda"
