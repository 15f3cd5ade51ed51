"""Gathering the sharded optimizer state into one plain state dict on a recipient rank.

[Note: Tensor consolidation]
Only small metadata (state keys, shapes, dtypes, non-tensor values) goes through the object
collective; tensor payloads never get pickled. For each source rank in turn, its state tensors
are packed into one flat buffer per dtype and sent point to point to the recipient (or broadcast
when every rank is a recipient), which receives straight into host memory that becomes the
returned tensors (views of per-source flat buffers). Other ranks never receive the full state;
the recipient's peak is the full state in host memory plus, with NCCL, one source's buffer on the
device. The metadata exchange doubles as the agreement step: a recipient mismatch raises on every
rank before any tensor moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._dist import _comm_device, _global_rank
from shardkit.partition import all_gather_objects

__all__: list[str] = []

# (global index, state key, shape, dtype, skipped)
_TensorMeta = tuple[int, str, tuple[int, ...], torch.dtype, bool]


def _describe(
    local: Mapping[int, Mapping[str, Any]], skipped: set[int]
) -> tuple[list[_TensorMeta], dict[int, dict[str, Any]]]:
    tensors: list[_TensorMeta] = []
    values: dict[int, dict[str, Any]] = {}
    for idx in sorted(local):
        values[idx] = {}
        for key, v in local[idx].items():
            if isinstance(v, torch.Tensor):
                tensors.append((idx, key, tuple(v.shape), v.dtype, idx in skipped))
            else:
                values[idx][key] = v
    return tensors, values


def _by_dtype(tensors: list[_TensorMeta]) -> list[tuple[torch.dtype, list[_TensorMeta]]]:
    groups: dict[torch.dtype, list[_TensorMeta]] = {}
    for m in tensors:
        if not m[4]:
            groups.setdefault(m[3], []).append(m)
    return [(d, groups[d]) for d in sorted(groups, key=str)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _consolidate(
    local: Mapping[int, Mapping[str, Any]],
    group: dist.ProcessGroup,
    rank: int,
    recipient: int,
    skipped: set[int],
) -> dict[int, dict[str, Any]] | None:
    """Collective. Returns the full ``{global index: state}`` on recipients, ``None`` elsewhere.

    Args:
        local: this rank's state, keyed by global index (live tensors; they are copied).
        recipient: group rank receiving the state, or -1 for every rank.
        skipped: global indices whose tensors are not moved; the recipient gets ``meta``
            tensors of the right shape and dtype in their place.
    """
    world = dist.get_world_size(group)
    tensors, values = _describe(local, skipped)
    gathered = all_gather_objects((recipient, tensors, values), group)  # See [Note: Object collectives without NumPy]
    recipients = [g[0] for g in gathered]
    if any(r != recipients[0] for r in recipients):
        raise ValueError(
            f"consolidate_state_dict: ranks passed different recipient ranks {recipients}; "
            f"every rank must pass the same recipient_rank."
        )
    receives = recipient in (-1, rank)
    device = _comm_device(group)
    out: dict[int, dict[str, Any]] | None = {} if receives else None
    for src in range(world):
        _, src_tensors, src_values = gathered[src]
        if out is not None:
            for idx, vals in src_values.items():
                out.setdefault(idx, {}).update(vals)
            for idx, key, shape, dtype, skip in src_tensors:
                if skip:
                    if src == rank:
                        out[idx][key] = local[idx][key].detach().to("cpu", copy=True)
                    else:
                        out[idx][key] = torch.empty(shape, dtype=dtype, device="meta")
        for dtype, metas in _by_dtype(src_tensors):
            total = sum(_numel(m[2]) for m in metas)
            if total == 0:
                # Zero-element tensors: nothing to move.
                if out is not None:
                    for idx, key, shape, dt, _ in metas:
                        out[idx][key] = torch.empty(shape, dtype=dt)
                continue
            host: torch.Tensor | None = None
            if src == rank:
                if out is not None and recipient != -1:
                    # Recipient's own shard: a host copy, no communication.
                    host = torch.cat(
                        [local[m[0]][m[1]].detach().reshape(-1).to("cpu") for m in metas]
                    )
                else:
                    wire = torch.cat(
                        [local[m[0]][m[1]].detach().reshape(-1).to(device) for m in metas]
                    )
                    if recipient == -1:
                        dist.broadcast(wire, src=_global_rank(group, src), group=group)
                        host = wire.to("cpu", copy=True)
                    else:
                        dist.send(wire, dst=_global_rank(group, recipient), group=group)
                    del wire
            elif out is not None:
                wire = torch.empty(total, dtype=dtype, device=device)
                if recipient == -1:
                    dist.broadcast(wire, src=_global_rank(group, src), group=group)
                else:
                    dist.recv(wire, src=_global_rank(group, src), group=group)
                host = wire if wire.device.type == "cpu" else wire.to("cpu")
                del wire
            if out is not None and host is not None:
                off = 0
                for idx, key, shape, _, _ in metas:
                    n = _numel(shape)
                    out[idx][key] = host[off : off + n].view(shape)
                    off += n
    return out
