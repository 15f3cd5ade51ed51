"""No per-step allocation churn on the ZeRO-1 paths (issue 37): after the first step, a step of
torch DDP + ``ShardedOptimizer`` (the optimizer's own step and broadcasts) and of DDP with
``register_zero_overlap`` (the step inside the comm hook) allocates no large tensor of
shardkit's own.

Counted with ``shardkit.testing.LargeAllocations`` (64 KiB and more, asked for by shardkit code;
see [Note: Counting our allocations] in ``shardkit.testing._allocations``): the gradients
autograd allocates, DDP's reducer (C++) and what Gloo allocates inside its collectives are not
shardkit's. With ``master_dtype`` the fp32 gradients of each chunk go into one buffer kept from
the first step ([Note: Master weights] in ``shardkit.optim._master``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer
from shardkit.overlap import register_zero_overlap
from shardkit.testing import LargeAllocations, world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH = 512


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("masters", [False, True])
@world(2, timeout=120)
def test_zero1_steps_allocate_nothing_large(hook: bool, masters: bool) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if masters else torch.float32
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]).to(dtype)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=1)
    opt = ShardedOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=1e-3,
        fused=True,
        master_dtype=torch.float32 if masters else None,
        master_grad_bucket_bytes=1 << 20,
    )
    if hook:
        register_zero_overlap(ddp, opt)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    counts = []
    for _ in range(4):
        with LargeAllocations() as allocs:
            opt.zero_grad()
            ddp(x.to(dtype)).float().square().mean().backward()
            opt.step()
        counts.append(allocs.records)
    assert counts[0], "the first step allocates the optimizer state (and the masters' buffer)"
    for step, records in enumerate(counts[1:], start=2):
        assert records == [], (step, records)
