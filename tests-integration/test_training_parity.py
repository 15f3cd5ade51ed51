"""The tiny GPT trained data-parallel with shardkit-optim, then with bf16 autocast +
ShardedGradScaler + clipping, each against plain DDP + plain AdamW run in the same rank processes
on the same data (the shardkit-overlap hooks: test_overlap_parity.py).

Every step compares every parameter of the two runs. Plain fp32 runs must be bit-for-bit equal
(ZeRO-1 only changes *where* each parameter's AdamW update is computed, not how). The
autocast/scaler/clipping run is compared within a stated tolerance: the sharded global norm sums
per-rank partial sums of squares where ``torch.nn.utils.clip_grad_norm_`` takes the norm of
per-tensor norms, so the clip coefficient differs in the last bits.
"""

from __future__ import annotations

import copy
import math

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
from shardkit.testing import world
from torch.nn.parallel import DistributedDataParallel as DDP

_STEPS = 4
_ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _pair(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = make_model(seed)
    return model, copy.deepcopy(model)


def _consolidated(zero: ShardedOptimizer) -> dict[str, object]:
    zero.consolidate_state_dict(recipient_rank=-1)
    return zero.state_dict()


@world(2)
def test_sharded_optimizer_matches_plain_ddp() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model, ref_model = _pair()
    ddp, ref = DDP(model), DDP(ref_model)
    zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **_ADAMW)
    plain = torch.optim.AdamW(ref_model.parameters(), **_ADAMW)
    # The tied head/embedding weight is one parameter: it must be owned (and stepped) once.
    assert sum(len(g["params"]) for g in zero.param_groups) == len(list(model.parameters()))
    losses = []
    for step in range(_STEPS):
        batch = local_batch(step, rank, size)
        loss = lm_loss(ddp, batch)
        loss.backward()
        zero.step()
        zero.zero_grad()
        ref_loss = lm_loss(ref, batch)
        ref_loss.backward()
        plain.step()
        plain.zero_grad()
        assert torch.equal(loss, ref_loss), f"step {step}: loss {loss} vs {ref_loss}"
        assert_same_params(snapshot(model), snapshot(ref_model), f"rank {rank} step {step}")
        losses.append(loss.item())
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
    # Frozen block: untouched, and no optimizer state anywhere.
    frozen = make_model().blocks[1].state_dict()
    for k, v in model.blocks[1].state_dict().items():
        assert torch.equal(v, frozen[k]), k
    assert_same_state(_consolidated(zero), plain.state_dict(), f"rank {rank} final state")
    # Each rank holds only its shard of the AdamW state.
    mine = sum(
        v.numel() for st in zero.optim.state.values() for v in st.values() if torch.is_tensor(v)
    )
    full = sum(v.numel() for st in plain.state.values() for v in st.values() if torch.is_tensor(v))
    assert 0 < mine < full


# The scaler/clipping run: tolerance for the clip coefficient's rounding (see module docstring),
# which then passes through bf16 autocast for a few steps.
_AMP_ATOL = 1e-5
_AMP_RTOL = 1e-4
_MAX_NORM = 0.5
_INF_STEP = 2


@world(2)
def test_bf16_autocast_scaler_and_clipping_match_plain_ddp() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model, ref_model = _pair(seed=2)
    ddp, ref = DDP(model), DDP(ref_model)
    zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **_ADAMW)
    plain = torch.optim.AdamW(ref_model.parameters(), **_ADAMW)
    settings = {"init_scale": 2.0**10, "growth_interval": 2}
    scaler = ShardedGradScaler("cpu", **settings)
    ref_scaler = torch.amp.GradScaler("cpu", **settings)
    clipped = False
    scales = []
    for step in range(_STEPS + 1):
        batch = local_batch(step, rank, size)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(ddp, batch)
        scaler.scale(loss).backward()
        if step == _INF_STEP and rank == 1:
            # An overflow seen by ONE rank only: every rank must skip this step together.
            next(model.blocks[0].parameters()).grad.view(-1)[0] = math.inf
        scaler.unscale_(zero)
        norm = zero.clip_grad_norm(_MAX_NORM)
        scaler.step(zero)
        scaler.update()
        zero.zero_grad()

        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = lm_loss(ref, batch)
        ref_scaler.scale(ref_loss).backward()
        if step == _INF_STEP:
            # The reference overflows on every rank (plain GradScaler does not agree across
            # ranks, so a one-rank overflow would make plain DDP diverge).
            next(ref_model.blocks[0].parameters()).grad.view(-1)[0] = math.inf
        ref_scaler.unscale_(plain)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), _MAX_NORM)
        ref_scaler.step(plain)
        ref_scaler.update()
        plain.zero_grad()

        assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale())
        scales.append(scaler.get_scale())
        if step != _INF_STEP:
            assert torch.allclose(norm, ref_norm, rtol=1e-5), (step, norm, ref_norm)
            clipped |= bool(ref_norm > _MAX_NORM)
        assert_close_params(
            snapshot(model), snapshot(ref_model), f"rank {rank} step {step}",
            atol=_AMP_ATOL, rtol=_AMP_RTOL,
        )  # fmt: skip
    assert clipped, "clipping never engaged: lower _MAX_NORM so the test exercises it"
    # Growth after two good steps, back-off at the overflow (its step skipped), growth again.
    assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11], scales
    # Every rank ends with identical params (a one-rank skip would have split them).
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
