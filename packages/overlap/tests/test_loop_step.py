"""AMP grad scaling and clipping (the step runs in the loop) and broadcast coalescing.

Tolerances: with a scaler only, parity with DDP + GradScaler + Adam is bit-for-bit (same reduced
gradients, same elementwise math). With clipping, the sharded global norm sums per-rank partial
norms in another order than ``torch.nn.utils.clip_grad_norm_``: the clip coefficient may differ
in the last float32 bit, so params are compared with ``rtol=1e-5, atol=1e-6``.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedGradScaler, ShardedOptimizer
from shardkit.overlap import register_zero_overlap
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

CAP_MB = 0.0006  # ~600 bytes: several buckets once DDP rebuilds them


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
        nn.Linear(8, 2),
    )


def _batch(step: int, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
    if poison and dist.get_rank() == 1:
        x[0, 0] = math.inf  # one rank overflows: every rank must skip
    return x, y


@world(2)
@pytest.mark.parametrize("mode", ["scaler", "clip", "scaler_clip", "standard_recipe"])
def test_scaler_and_clipping_parity(mode: str) -> None:
    scaled = mode != "clip"
    clip = 0.05 if mode != "scaler" else None
    net = _net()
    ref_net = copy.deepcopy(net)
    ddp, ref = DDP(net, bucket_cap_mb=CAP_MB), DDP(ref_net, bucket_cap_mb=CAP_MB)
    zero = ShardedOptimizer(net.parameters(), torch.optim.Adam, lr=0.01)
    ref_opt = torch.optim.Adam(ref_net.parameters(), lr=0.01)
    kw: dict[str, Any] = {"init_scale": 2.0**10}
    scaler = ShardedGradScaler("cpu", group=zero.group, **kw) if scaled else None
    ref_scaler = torch.amp.GradScaler("cpu", enabled=scaled, **kw)
    declared = None if mode == "standard_recipe" else clip
    overlap = register_zero_overlap(ddp, zero, grad_scaler=scaler, max_grad_norm=declared)
    assert overlap.loop_step
    try:
        for step in range(4):
            x, y = _batch(step, poison=scaled and step == 1)
            before = [p.detach().clone() for p in net.parameters()]
            for model in (ddp, ref):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaled):
                    loss = nn.functional.mse_loss(model(x), y)
                (ref_scaler.scale(loss) if scaler is None or model is ref else scaler.scale(loss)).backward()
            if mode == "standard_recipe":
                assert scaler is not None and clip is not None
                scaler.unscale_(zero)
                zero.clip_grad_norm(clip)
                scaler.step(zero)
            else:
                overlap.step()
                if clip is not None:
                    assert overlap.last_grad_norm is not None
            if scaler is not None:
                scaler.update()
            ref_scaler.unscale_(ref_opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref_net.parameters(), clip)
            ref_scaler.step(ref_opt)
            ref_scaler.update()
            zero.zero_grad()
            ref_opt.zero_grad()
            tol = {"rtol": 0.0, "atol": 0.0} if clip is None else {"rtol": 1e-5, "atol": 1e-6}
            for p, q in zip(net.parameters(), ref_net.parameters(), strict=True):
                torch.testing.assert_close(p, q, **tol, msg=lambda m, s=step: f"step {s + 1}: {m}")
            if scaler is not None:
                assert scaler.get_scale() == ref_scaler.get_scale()
                skipped = all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
                assert skipped == (step == 1), f"step {step + 1}: skipped={skipped}"
    finally:
        overlap.close()


@world(2)
@pytest.mark.parametrize("shard_buckets", [True, False])
def test_one_broadcast_per_bucket_and_owner(shard_buckets: bool) -> None:
    """Once DDP has rebuilt its buckets (from iteration 2), each bucket's params are synced
    with exactly one broadcast per owning rank (the flat buffers follow DDP's buckets)."""
    net = _net()
    ddp = DDP(net, bucket_cap_mb=CAP_MB)
    zero = ShardedOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    overlap = register_zero_overlap(ddp, zero, shard_buckets=shard_buckets)
    calls: list[tuple[int, int]] = []
    original = zero.sync_params

    def counting(params: Any = None, async_op: bool = False) -> list[dist.Work]:
        works = original(params, async_op)
        owners = {zero.param_to_rank[p] for p in params}
        calls.append((len(owners), len(works)))
        return works

    zero.sync_params = counting  # type: ignore[method-assign]
    try:
        for step in range(3):
            calls.clear()
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            zero.step()
            zero.zero_grad()
        assert len(calls) >= 3, calls  # several buckets
        assert all(owners == works for owners, works in calls), calls
    finally:
        overlap.close()


@world(2)
def test_clip_mismatch_raises_on_every_rank() -> None:
    """Issue 39: ranks that declare different ``max_grad_norm`` raise ``ValueError`` at the
    loop step on every rank, naming each rank's values (shardkit-optim's one sharded clip)."""
    net = _net()
    ddp = DDP(net, bucket_cap_mb=CAP_MB)
    zero = ShardedOptimizer(net.parameters(), torch.optim.Adam, lr=0.01)
    overlap = register_zero_overlap(ddp, zero, max_grad_norm=1.0 if dist.get_rank() == 0 else 0.5)
    try:
        x, y = _batch(0)
        nn.functional.mse_loss(ddp(x), y).backward()
        before = [p.detach().clone() for p in net.parameters()]
        with pytest.raises(
            ValueError,
            match=r"ranks pass different \(max_norm, norm_type\): rank 0: \(1\.0, 2\.0\), "
            r"rank 1: \(0\.5, 2\.0\); pass the same values on every rank",
        ):
            overlap.step()
        assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
        # the norm type is agreed too (the loop step clips with the default 2.0)
        with pytest.raises(ValueError, match=r"rank 0: \(1\.0, 2\.0\), rank 1: \(1\.0, inf\)"):
            zero.clip_grad_norm(1.0, 2.0 if dist.get_rank() == 0 else math.inf)
    finally:
        overlap.close()
