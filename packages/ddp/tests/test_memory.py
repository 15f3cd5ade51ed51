"""Memory is what is alive: every live tensor storage, counted once, against ``memory_bytes()``.

Issue 25: under ShardedDataParallel no ZeRO-1 flat buffer, second master copy or
inner-optimizer leftover of the wrapped ``ShardedOptimizer`` stays alive, and
``memory_bytes()`` accounts for every live tensor the wrapper holds (within one bucket).
Issue 37: the staging pool (two buffers of the largest bucket) is kept between steps by default
and counted under ``"staging"``; ``keep_staging_buffers=False`` frees it after each step. What a
process keeps resident beyond its live tensors is measured by ``benchmarks/bench_memory.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import live_storages, world
from torch import nn

WIDTH = 256
LAYERS = 4
CAP_MB = 0.125


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(dtype)


@pytest.mark.parametrize("master", [False, True])
@world(2)
def test_live_tensors_match_memory_bytes_and_nothing_dead_stays(master: bool) -> None:
    _live_tensors_match_memory_bytes(master)


@world(3)
def test_live_tensors_match_memory_bytes_at_world_3() -> None:
    """At world 3 the pool holds Gloo's receive buffers for the second peer's chunks."""
    _live_tensors_match_memory_bytes(False)


def _live_tensors_match_memory_bytes(master: bool) -> None:
    before = set(live_storages(device_type="cpu"))
    dtype = torch.bfloat16 if master else torch.float32
    model = _model(dtype)
    opt = ShardedOptimizer(
        model.parameters(),
        optim=torch.optim.AdamW,
        lr=1e-3,
        master_dtype=torch.float32 if master else None,
    )
    sdp = ShardedDataParallel(model, opt, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    for step in range(2):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        x = torch.randn(8, WIDTH, generator=g).to(dtype)
        sdp(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    del x
    params = list(model.parameters())
    live = {
        ptr: n
        for ptr, n in live_storages([p.grad for p in params], device_type="cpu").items()
        if ptr not in before
    }
    held = sdp.memory_bytes()
    n = sum(p.numel() for p in params)
    bucket = max(b.flat.numel() * b.flat.element_size() for b in sdp._buckets)
    total = sum(live.values())
    # the pool: two buffers of the largest bucket, kept ([Note: Staging lifetime]), and on
    # Gloo the two receive buffers of (N-2)/N of it (one peer's chunk is received into the
    # grad shard: [Note: Gloo reduce-scatter point to point] in shardkit.optim._wire)
    world_size = dist.get_world_size()
    pool = 2 * bucket + 2 * max(world_size - 2, 0) * (bucket // world_size)
    assert pool <= held["staging"] <= pool + 4 * 64, held
    # Every live byte is accounted for, within one bucket (the module's own small tensors).
    assert abs(total - sum(held.values())) <= bucket, (total, held)
    # Nothing of ZeRO-1 survives: params + grad shard + state (+ masters) + staging, no
    # second flat copy of the params (4 or 2 bytes per param).
    param_bytes = 2 if master else 4
    theory = param_bytes + (param_bytes + 12) / world_size if master else 4 + 12 / world_size
    assert total / n <= theory + held["staging"] / n + bucket / n, (total / n, theory, held)


@world(2)
def test_keep_staging_buffers_keeps_the_pool_between_steps() -> None:
    held = {}
    for keep in (True, False):
        model = _model(torch.float32)
        opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(
            model, opt, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB, keep_staging_buffers=keep
        )
        for _ in range(2):
            sdp(torch.randn(4, WIDTH)).square().mean().backward()
            opt.step()
        held[keep] = sdp.memory_bytes()["staging"]
    assert held[True] > 0  # kept: [Note: Staging lifetime]
    assert held[False] == 0  # freed once the step has waited for the reductions
    other = _model(torch.float32)
    other_opt = ShardedOptimizer(other.parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="keep_staging_buffers must be a bool"):
        ShardedDataParallel(other, other_opt, keep_staging_buffers=1)  # type: ignore[arg-type]
