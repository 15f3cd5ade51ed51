"""The GPT parity suites on CUDA: shardkit-optim alone and stepped by the shardkit-overlap hooks,
against plain DDP + AdamW in the same rank processes. Three worlds: NCCL with one GPU per rank
(world 2, needs 2 GPUs), NCCL at world 1, and two Gloo ranks sharing one GPU (the multi-rank
CUDA path on a one-GPU machine). Skipped, with the reason, where the GPUs are missing (the Gloo
suites cover the CPU).

Tolerance: atol 1e-6 + rtol 1e-5 per element, not bit-for-bit. On CUDA, torch's AdamW uses the
multi-tensor (foreach) kernels, over all params in the plain run but over each rank's shard (or
each bucket's owned params) in the sharded runs, and NCCL's all-reduce order is not fixed, so
equality is to rounding. Attention runs on the math SDPA kernel, whose backward is deterministic.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _gpt import assert_close_params, lm_loss, local_batch, make_model, snapshot
from shardkit.optim import ShardedOptimizer
from shardkit.overlap import register_zero_overlap
from shardkit.testing import rank_cuda_device, world
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

_ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
_ATOL, _RTOL = 1e-6, 1e-5


def _sharded_and_overlapped_match_plain_ddp() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    device = rank_cuda_device()
    ref_model = make_model(seed=8).to(device)
    sharded_model, overlap_model = copy.deepcopy(ref_model), copy.deepcopy(ref_model)
    ref = DDP(ref_model, device_ids=[device.index])
    sharded = DDP(sharded_model, device_ids=[device.index])
    overlapped = DDP(overlap_model, device_ids=[device.index], bucket_cap_mb=0.01)
    plain = torch.optim.AdamW(ref_model.parameters(), **_ADAMW)
    zero = ShardedOptimizer(sharded_model.parameters(), torch.optim.AdamW, **_ADAMW)
    zero_overlap = ShardedOptimizer(overlap_model.parameters(), torch.optim.AdamW, **_ADAMW)
    hook = register_zero_overlap(overlapped, zero_overlap)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            for step in range(4):
                batch = local_batch(step, rank, size).to(device)
                for ddp, opt in ((ref, plain), (sharded, zero), (overlapped, zero_overlap)):
                    lm_loss(ddp, batch).backward()
                    opt.step()
                    opt.zero_grad()
                want = snapshot(ref_model)
                for name, model in (("sharded", sharded_model), ("overlap", overlap_model)):
                    assert_close_params(
                        snapshot(model), want, f"rank {rank} {name} step {step}",
                        atol=_ATOL, rtol=_RTOL,
                    )  # fmt: skip
    finally:
        hook.close()


@pytest.mark.cuda
@world(2, backend="nccl")
def test_sharded_and_overlapped_match_plain_ddp_on_nccl() -> None:
    _sharded_and_overlapped_match_plain_ddp()


@pytest.mark.cuda
@world(1, backend="nccl")
def test_sharded_and_overlapped_match_plain_ddp_on_nccl_world1() -> None:
    _sharded_and_overlapped_match_plain_ddp()


@pytest.mark.cuda
@world(2)
def test_sharded_and_overlapped_match_plain_ddp_gloo_ranks_sharing_a_gpu() -> None:
    _sharded_and_overlapped_match_plain_ddp()
