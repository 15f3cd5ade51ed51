"""Process-group helpers: rank translation, communication device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AllGather", "global_rank"]

AllGather = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], object]
"""``all_gather(output, input, group)``: a blocking all-gather of every rank's ``input`` into
one ``output`` tensor; a driver passes its own to count the bytes. The default is torch's
single-tensor all-gather (``all_gather_single``, ``all_gather_into_tensor`` before it)."""


# [Note: Rank numbering]
# Everything the optimizer stores (``rank``, partition owners, ``recipient_rank``) is a rank
# *within the optimizer's group*. torch's collectives take global ranks for ``src``/``dst``, so
# every call site translates with ``global_rank`` right before the collective and nowhere else.
# With the default group both numberings coincide, which is why a missing translation only shows
# up with sub groups (tested with a group of ranks {1, 2} out of a world of 3).


def _resolve_group(group: Any) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shardkit.optim needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(...) before building a ShardedOptimizer "
            "(for a single process use world_size=1)."
        )
    if group is None:
        default = dist.group.WORLD
        if not isinstance(default, dist.ProcessGroup):
            raise RuntimeError("the default process group is not initialised")
        return default
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__}: {group!r}"
        )
    return group


def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    """Translates a rank of ``group`` into the global numbering, as torch's collectives take
    ``src`` / ``dst``. See [Note: Rank numbering]."""
    return dist.get_global_rank(group, group_rank)


def _comm_device(group: dist.ProcessGroup) -> torch.device:
    """The device on which this group's collectives expect their tensors."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduces_on(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend runs collectives on tensors of ``device`` directly.

    Gloo takes CPU and CUDA tensors (staging CUDA ones through host memory); NCCL only CUDA.
    """
    backend = str(dist.get_backend(group)).lower()
    return device.type == "cuda" if "nccl" in backend else device.type in ("cpu", "cuda")
