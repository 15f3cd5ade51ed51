"""The tiny GPT with its block stack offloaded by shardkit-offload (each block its own slice,
streamed from host memory), trained against the same model without offload: bit-for-bit equal
losses, gradients and parameters after every step, in a single process and data-parallel (DDP +
shardkit-optim on 2 ranks against plain DDP + AdamW), with and without activation checkpointing.
On CPU compute and offload device coincide; the scheduling code that runs is the same as on GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _gpt import assert_same_params, lm_loss, local_batch, make_model
from shardkit.offload import offload_blocks
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch.nn.parallel import DistributedDataParallel as DDP

_ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
_STEPS = 3


def _key(name: str) -> str:
    # offload_blocks wraps each block (``blocks.0.block.qkv.weight``); its state_dict keeps the
    # original keys (``blocks.0.qkv.weight``), which is how the two models are compared.
    return name.replace(".block.", ".")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        _key(n): None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
    }


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("checkpoint_activation", [False, True], ids=["plain", "ckpt"])
def test_offloaded_blocks_match_plain_model(checkpoint_activation: bool) -> None:
    model = make_model(seed=5)
    ref_model = copy.deepcopy(model)
    handle = offload_blocks(model, "blocks", "cpu", checkpoint_activation=checkpoint_activation)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **_ADAMW)
    ref_opt = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], **_ADAMW)
    try:
        for step in range(_STEPS):
            batch = local_batch(step, 0, 1)
            loss = lm_loss(model, batch)
            ref_loss = lm_loss(ref_model, batch)
            assert torch.equal(loss, ref_loss), (step, loss, ref_loss)
            loss.backward()
            ref_loss.backward()
            got, want = _grads(model), _grads(ref_model)
            assert got.keys() == want.keys()
            for name, g in want.items():
                same = got[name] is None if g is None else torch.equal(got[name], g)
                assert same, f"step {step}: grad of {name} differs"
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            assert_same_params(_weights(model), _weights(ref_model), f"step {step}")
    finally:
        handle.release()


@world(2)
def test_offloaded_blocks_with_ddp_and_sharded_optimizer_match_plain_ddp() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=6)
    ref_model = copy.deepcopy(model)
    handle = offload_blocks(model, "blocks", "cpu", checkpoint_activation=True)
    try:
        ddp, ref = DDP(model), DDP(ref_model)
        zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **_ADAMW)
        plain = torch.optim.AdamW(ref_model.parameters(), **_ADAMW)
        for step in range(_STEPS):
            batch = local_batch(step, rank, size)
            lm_loss(ddp, batch).backward()
            zero.step()
            zero.zero_grad()
            lm_loss(ref, batch).backward()
            plain.step()
            plain.zero_grad()
            assert_same_params(_weights(model), _weights(ref_model), f"rank {rank} step {step}")
    finally:
        handle.release()
