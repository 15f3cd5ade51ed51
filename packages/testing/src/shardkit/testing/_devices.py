"""Which device a rank computes on in a GPU test."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["rank_cuda_device"]


def rank_cuda_device() -> torch.device:
    """This rank's CUDA device, made current: ``cuda:(rank % device_count)``.

    With fewer GPUs than ranks, ranks share GPUs. That works over Gloo, whose collectives accept
    CUDA tensors and stage them through host memory (all-reduce, broadcast, all-gather,
    reduce-scatter, reduce, gather, scatter, all-to-all, object collectives), but not over NCCL,
    which refuses two ranks on one device: ``@world(n, backend="nccl")`` tests skip unless
    ``n`` GPUs are visible. Gloo's point-to-point ``send``/``recv`` on CUDA tensors aborts the
    process (seen with torch 2.11 on an H100); keep point-to-point traffic on host tensors.

    Returns:
        The device, also set as the current CUDA device of this process.

    Raises:
        RuntimeError: no CUDA device is visible (mark the test ``@pytest.mark.cuda`` so it is
            skipped instead), or the default process group is not initialised.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "rank_cuda_device() needs a CUDA GPU and none is visible; mark the test "
            "@pytest.mark.cuda so it is skipped where no GPU is present"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "rank_cuda_device() is called on a rank: use it inside a @world test body"
        )
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
