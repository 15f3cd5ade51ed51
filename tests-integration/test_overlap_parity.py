"""The tiny GPT trained with shardkit-optim stepped by the shardkit-overlap DDP comm hooks
(bucket by bucket, inside backward) against plain DDP + plain AdamW in the same rank processes:
bit-for-bit equal parameters after every step, and equal final optimizer state. Then the hooks
with bf16 autocast + ShardedGradScaler + clipping declared, where the step moves to the loop
(``ZeroOverlap.step()`` unscales, clips and steps), against plain DDP + GradScaler +
``clip_grad_norm_`` within a stated tolerance (the sharded global norm sums per-rank partial
sums of squares, torch takes the norm of per-tensor norms: the clip coefficient differs in the
last bits).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from _gpt import (
    assert_close_params,
    assert_same_params,
    assert_same_state,
    lm_loss,
    local_batch,
    make_model,
    snapshot,
)
from shardkit.optim import ShardedGradScaler, ShardedOptimizer
from shardkit.overlap import register_zero_overlap
from shardkit.testing import world
from torch.nn.parallel import DistributedDataParallel as DDP

_STEPS = 4
_ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
# Small buckets: the tiny model spreads over several DDP buckets, so the overlap hooks step
# bucket by bucket (the interesting case) rather than all at once.
_BUCKET_MB = 0.01


def _pair(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = make_model(seed)
    return model, copy.deepcopy(model)


def _consolidated(zero: ShardedOptimizer) -> dict[str, object]:
    zero.consolidate_state_dict(recipient_rank=-1)
    return zero.state_dict()


@pytest.mark.parametrize(
    ("interleaved", "shard_buckets"), [(True, True), (False, False)], ids=["interleaved", "at-last"]
)
@world(2)
def test_overlap_hooks_match_plain_ddp(interleaved: bool, shard_buckets: bool) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model, ref_model = _pair(seed=1)
    ddp = DDP(model, bucket_cap_mb=_BUCKET_MB)
    ref = DDP(ref_model, bucket_cap_mb=_BUCKET_MB)
    zero = ShardedOptimizer(
        [
            {"params": [p for n, p in model.named_parameters() if "blocks" in n]},
            {"params": [p for n, p in model.named_parameters() if "blocks" not in n], "lr": 1e-3},
        ],
        torch.optim.AdamW,
        **_ADAMW,
    )
    plain = torch.optim.AdamW(
        [
            {"params": [p for n, p in ref_model.named_parameters() if "blocks" in n]},
            {
                "params": [p for n, p in ref_model.named_parameters() if "blocks" not in n],
                "lr": 1e-3,
            },
        ],
        **_ADAMW,
    )
    overlap = register_zero_overlap(ddp, zero, interleaved=interleaved, shard_buckets=shard_buckets)
    try:
        for step in range(_STEPS):
            batch = local_batch(step, rank, size)
            before = snapshot(model)
            lm_loss(ddp, batch).backward()
            # The hooks stepped inside backward: the params moved before any step() call.
            assert overlap.stepped
            assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
            # The loop's usual step consumes the hooks' update (a no-op); a second one has no
            # update to consume and must raise rather than step twice or silently do nothing.
            zero.step()
            with pytest.raises(RuntimeError, match="backward"):
                zero.step()
            zero.zero_grad()
            lm_loss(ref, batch).backward()
            plain.step()
            plain.zero_grad()
            assert_same_params(snapshot(model), snapshot(ref_model), f"rank {rank} step {step}")
    finally:
        overlap.close()
    assert_same_state(_consolidated(zero), plain.state_dict(), f"rank {rank} final state")


_AMP_ATOL = 1e-5
_AMP_RTOL = 1e-4
_MAX_NORM = 0.5
_INF_STEP = 2


@world(2)
def test_overlap_with_bf16_scaler_and_clipping_matches_plain_ddp() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model, ref_model = _pair(seed=7)
    ddp = DDP(model, bucket_cap_mb=_BUCKET_MB)
    ref = DDP(ref_model, bucket_cap_mb=_BUCKET_MB)
    zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **_ADAMW)
    plain = torch.optim.AdamW(ref_model.parameters(), **_ADAMW)
    settings = {"init_scale": 2.0**10, "growth_interval": 2}
    scaler = ShardedGradScaler("cpu", **settings)
    ref_scaler = torch.amp.GradScaler("cpu", **settings)
    overlap = register_zero_overlap(ddp, zero, grad_scaler=scaler, max_grad_norm=_MAX_NORM)
    scales = []
    try:
        for step in range(_STEPS + 1):
            batch = local_batch(step, rank, size)
            before = snapshot(model)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(ddp, batch)
            scaler.scale(loss).backward()
            # A scaler is declared: the hooks only reduced, nothing moved yet.
            assert_same_params(snapshot(model), before, f"rank {rank} step {step} after backward")
            if step == _INF_STEP and rank == 1:
                next(model.blocks[0].parameters()).grad.view(-1)[0] = math.inf  # one rank only
            overlap.step()  # unscale, clip, step (or skip on every rank)
            scaler.update()
            zero.zero_grad()

            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_loss = lm_loss(ref, batch)
            ref_scaler.scale(ref_loss).backward()
            if step == _INF_STEP:
                next(ref_model.blocks[0].parameters()).grad.view(-1)[0] = math.inf
            ref_scaler.unscale_(plain)
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), _MAX_NORM)
            ref_scaler.step(plain)
            ref_scaler.update()
            plain.zero_grad()

            assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale())
            scales.append(scaler.get_scale())
            assert_close_params(
                snapshot(model), snapshot(ref_model), f"rank {rank} step {step}",
                atol=_AMP_ATOL, rtol=_AMP_RTOL,
            )  # fmt: skip
    finally:
        overlap.close()
    assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11], scales
