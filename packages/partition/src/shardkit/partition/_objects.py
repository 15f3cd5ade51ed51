"""Gathering small picklable objects over a process group without NumPy.

[Note: Object collectives without NumPy]
torch's ``all_gather_object`` / ``broadcast_object_list`` turn the received bytes back into
objects through ``Tensor.numpy()``, so they fail with "Numpy is not available" wherever NumPy is
not installed, and torch does not depend on NumPy. Every shardkit package that exchanges
metadata between ranks (fingerprints, agreement checks, consolidation headers) uses
:func:`all_gather_objects` instead: pickle to a ``uint8`` tensor, all-gather the lengths, then the
padded payloads, and unpickle from ``bytes(tensor.tolist())``. Payloads are small (metadata only);
tensors that carry real data go through tensor collectives, never through this function.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["all_gather_objects", "comm_device"]


def comm_device(group: ProcessGroup | None = None) -> torch.device:
    """The device a group's collectives expect tensors on: the current CUDA device for NCCL,
    else the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl" or "nccl" in str(backend).split(","):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_objects(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order. Collective over ``group``.

    A NumPy-free replacement for ``torch.distributed.all_gather_object``. See
    [Note: Object collectives without NumPy].

    Args:
        obj: a small picklable object (metadata; not tensor payloads).
        group: the process group (default: the default group).

    Raises:
        TypeError: ``obj`` cannot be pickled (raised before any communication would deadlock
            the others: the length exchange still runs, with the error recorded, and every rank
            raises).
    """
    device = comm_device(group)
    world = dist.get_world_size(group)
    error: str | None = None
    try:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        payload = b""
    # Length -1 marks a rank whose object could not be pickled.
    length = torch.tensor([len(payload) if error is None else -1], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t.item()) for t in lengths]
    if any(s < 0 for s in sizes):
        bad = [r for r, s in enumerate(sizes) if s < 0]
        raise TypeError(
            f"all_gather_objects: the object on rank(s) {bad} cannot be pickled"
            + (f" (here: {error})" if error else "")
            + "; pass plain Python data (numbers, strings, tuples, dicts)"
        )
    longest = max(sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [pickle.loads(bytes(t[:n].cpu().tolist())) for t, n in zip(out, sizes, strict=True)]
