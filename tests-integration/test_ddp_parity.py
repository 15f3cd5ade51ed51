"""The tiny GPT (tied LM head, a frozen block) trained with shardkit-ddp's ShardedDataParallel
(ZeRO-2) + ShardedOptimizer(AdamW) at world 2, against plain DDP + AdamW on the same data:
bit-for-bit params after every step (a sum of two ranks' gradients does not depend on the
order), with the param all-gather at the end of the step and overlapped with the next forward,
and the consolidated optimizer state equal to the plain optimizer's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _gpt import assert_same_params, lm_loss, local_batch, make_model, snapshot
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch.nn.parallel import DistributedDataParallel as DDP

_ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
_STEPS = 3


@pytest.mark.parametrize("overlap", [False, True], ids=["gather-in-step", "gather-in-forward"])
@world(2)
def test_gpt_sharded_ddp_matches_ddp(overlap: bool) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=7)
    ref_model = copy.deepcopy(model)
    ref = DDP(ref_model)
    plain = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], **_ADAMW)
    opt = ShardedOptimizer(
        [p for p in model.parameters() if p.requires_grad], optim=torch.optim.AdamW, **_ADAMW
    )
    sdp = ShardedDataParallel(model, opt, bucket_cap_mb=0.01, overlap_param_gather=overlap)
    for step in range(_STEPS):
        batch = local_batch(step, rank, size)
        for m, o in ((ref, plain), (sdp, opt)):
            o.zero_grad()
            lm_loss(m, batch).backward()
            o.step()
        if not overlap:  # with overlap the params are only final once a forward waited
            assert_same_params(snapshot(model), snapshot(ref_model), f"rank {rank} step {step}")
    # state_dict() waits for the gathers still in flight; the forwards above waited per layer
    got = {k: v for k, v in model.state_dict().items() if k in snapshot(ref_model)}
    assert_same_params(got, snapshot(ref_model), f"rank {rank} final")
    full = opt.state_dict(all_ranks=True)
    want = plain.state_dict()
    assert sorted(full["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(full["state"][i][k]), torch.as_tensor(v)), (i, k)
