"""Mid-training changes to what is trained, with shardkit-optim against plain DDP + AdamW:
unfreezing a block, freezing another, adding a param group (progressive unfreezing with its own
learning rate), and unfreezing without telling the optimizer (it must notice, warn and
repartition). Parameters are compared bit-for-bit after every step, and the consolidated state
against the plain optimizer's at the end.

DDP only reduces the params that required grad when it was built, so, as users must, both runs
re-wrap the model in DDP after each ``requires_grad`` change.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _gpt import assert_same_params, assert_same_state, lm_loss, local_batch, make_model, snapshot
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch.nn.parallel import DistributedDataParallel as DDP

_ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
_NEW_GROUP = {"lr": 1e-2, "weight_decay": 0.0}


@world(2)
def test_freeze_unfreeze_and_added_group_match_plain_ddp() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=4, frozen_block=1)
    ref_model = copy.deepcopy(model)

    def initial(m: torch.nn.Module) -> list[torch.nn.Parameter]:
        # blocks.2 trains (DDP reduces it) but no optimizer steps it until its group is added.
        return [p for n, p in m.named_parameters() if not n.startswith("blocks.2.")]

    zero = ShardedOptimizer(initial(model), torch.optim.AdamW, **_ADAMW)
    plain = torch.optim.AdamW(initial(ref_model), **_ADAMW)

    def wrap() -> tuple[DDP, DDP]:
        return DDP(model), DDP(ref_model)

    ddp, ref = wrap()
    blocks2_before = snapshot(model.blocks[2])
    for step in range(8):
        if step == 2:  # unfreeze block 1
            for m in (model, ref_model):
                m.blocks[1].requires_grad_(True)
            zero.refresh_trainable()
            ddp, ref = wrap()
        if step == 4:  # freeze block 0, start training block 2 with its own hyperparameters
            assert_same_params(
                snapshot(model.blocks[2]), blocks2_before, "blocks.2 before its group"
            )
            for m in (model, ref_model):
                m.blocks[0].requires_grad_(False)
            zero.refresh_trainable()
            zero.add_param_group({"params": list(model.blocks[2].parameters()), **_NEW_GROUP})
            plain.add_param_group({"params": list(ref_model.blocks[2].parameters()), **_NEW_GROUP})
            ddp, ref = wrap()
        if step == 6:  # unfreeze block 0 and forget refresh_trainable(): step() must catch it
            for m in (model, ref_model):
                m.blocks[0].requires_grad_(True)
            ddp, ref = wrap()
        batch = local_batch(step, rank, size)
        lm_loss(ddp, batch).backward()
        if step == 6:
            with pytest.warns(UserWarning, match="requires_grad changed"):
                zero.step()
        else:
            zero.step()
        zero.zero_grad()
        lm_loss(ref, batch).backward()
        plain.step()
        plain.zero_grad()
        assert_same_params(snapshot(model), snapshot(ref_model), f"rank {rank} step {step}")
    assert len(zero.param_groups) == 2 and zero.param_groups[1]["lr"] == _NEW_GROUP["lr"]
    zero.consolidate_state_dict(recipient_rank=-1)
    assert_same_state(zero.state_dict(), plain.state_dict(), f"rank {rank} final state")
