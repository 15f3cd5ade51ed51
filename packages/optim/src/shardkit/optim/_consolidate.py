"""Gathering the sharded optimizer state into one plain state dict on a recipient rank.

[Note: Tensor consolidation]
Only small metadata (state keys, shapes, dtypes, non-tensor values) goes through the object
collective; tensor payloads never get pickled. The metadata exchange doubles as the agreement
step: a recipient mismatch raises on every rank before any tensor moves, and from then on every
rank derives the same message plan from the same metadata, so sends and receives always pair up.

Sources are handled one at a time, in group-rank order. For each source and dtype the recipient
allocates ONE flat host buffer that becomes the storage of the returned tensors (they are views
of it), and the source's tensors arrive as a sequence of messages (see ``_plan``):

- a tensor of at least ``_DIRECT_BYTES`` is its own message, sent straight from the live state
  tensor (no packing copy on the sender) and, with Gloo, received straight into its slice of the
  recipient's host buffer (no staging copy on the recipient);
- smaller tensors (Adam's ``step`` scalars, biases) are packed into messages of up to
  ``_PACK_BYTES`` so a model with thousands of params does not pay thousands of round trips.

With NCCL each message is received into a device staging tensor and copied into the host buffer
before the next message, so the device holds at most one message of the full state. Other ranks
never receive anything (point to point to the recipient), except with ``recipient=-1`` where
every message is broadcast. The recipient's own shard is copied into its host buffer while the
first remote source's messages arrive (Gloo receives run on Gloo's own threads), so the result
is a snapshot: nothing in it aliases live optimizer state. Peak host memory on the recipient:
one full copy of the state; on senders: nothing beyond small packs.

Where the time goes (profiled at world 2, 134 MB of Adam state per rank, Gloo on a 2-core VM):
fresh host memory is expensive (first-touch page faults cost as much as the copy itself), so the
design minimises the number of fresh full-size buffers: one per remote shard on the recipient,
none on the senders. The previous design packed every source's shard into one buffer per dtype
on both sides (two extra full-size copies), which was ~60% of the consolidation time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._dist import _comm_device, global_rank
from shardkit.partition import all_gather_objects

__all__: list[str] = []

# (global index, state key, shape, dtype, skipped)
_TensorMeta = tuple[int, str, tuple[int, ...], torch.dtype, bool]

# Tensors of at least this many bytes travel alone, straight from/into their final memory.
_DIRECT_BYTES = 256 * 1024
# Smaller tensors are packed into messages of at most this many bytes.
_PACK_BYTES = 4 * 1024 * 1024


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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _by_dtype(tensors: list[_TensorMeta]) -> list[tuple[torch.dtype, list[_TensorMeta]]]:
    """The non-skipped, non-empty tensors grouped by dtype, in a rank-independent order."""
    groups: dict[torch.dtype, list[_TensorMeta]] = {}
    for m in tensors:
        if not m[4] and _numel(m[2]) > 0:
            groups.setdefault(m[3], []).append(m)
    return [(d, groups[d]) for d in sorted(groups, key=str)]


def _plan(metas: list[_TensorMeta], itemsize: int) -> list[list[_TensorMeta]]:
    """Splits one dtype's tensors (in order) into messages. See [Note: Tensor consolidation]."""
    messages: list[list[_TensorMeta]] = []
    pack: list[_TensorMeta] = []
    pack_bytes = 0
    for m in metas:
        nbytes = _numel(m[2]) * itemsize
        if nbytes >= _DIRECT_BYTES:
            if pack:
                messages.append(pack)
                pack, pack_bytes = [], 0
            messages.append([m])
            continue
        if pack and pack_bytes + nbytes > _PACK_BYTES:
            messages.append(pack)
            pack, pack_bytes = [], 0
        pack.append(m)
        pack_bytes += nbytes
    if pack:
        messages.append(pack)
    return messages


def _receives_in_place(device: torch.device) -> bool:
    """Whether messages land straight in host memory (CPU backends) or via a device stage."""
    return device.type == "cpu"


def _payload(
    local: Mapping[int, Mapping[str, Any]], message: list[_TensorMeta], device: torch.device
) -> torch.Tensor:
    """The sender's flat tensor for ``message``: the live tensor itself when possible."""
    parts: list[torch.Tensor] = [local[m[0]][m[1]].detach().reshape(-1) for m in message]
    if len(parts) == 1:
        # reshape(-1) of a contiguous tensor is a view; .to() is a no-op on the right device.
        return parts[0].to(device).contiguous()
    return torch.cat([p.to(device) for p in parts])


def _consolidate(
    local: Mapping[int, Mapping[str, Any]],
    group: dist.ProcessGroup,
    rank: int,
    recipient: int,
    skipped: set[int],
    extra: Any = None,
) -> tuple[dict[int, dict[str, Any]] | None, list[Any]]:
    """Collective. Returns the full ``{global index: state}`` on recipients (``None``
    elsewhere), and every rank's ``extra`` (in group-rank order, on every rank).

    See [Note: Tensor consolidation].

    Args:
        local: this rank's state, keyed by global index (live tensors; they are copied).
        group: the optimizer's process group.
        rank: this process's rank in ``group``.
        recipient: group rank receiving the state, or -1 for every rank.
        skipped: global indices (owned by this rank) whose tensors are not moved; the recipient
            gets ``meta`` tensors of the right shape and dtype in their place (or, when it owns
            them itself, a copy).
        extra: small picklable metadata of this rank's that rides in the metadata exchange
            (the pieces of params ZeRO-2 holds: [Note: One full state dict] in ``_full_state``).
    """
    world = dist.get_world_size(group)
    tensors, values = _describe(local, skipped)
    order = {idx: list(entry) for idx, entry in local.items()}
    # See [Note: Object collectives without NumPy].
    # (The arguments were checked on every rank before: ShardedOptimizer.consolidate_state_dict.)
    gathered = all_gather_objects((recipient, tensors, values, order, extra), group)
    recipients = [g[0] for g in gathered]
    if any(r != recipients[0] for r in recipients):
        raise ValueError(
            f"consolidate_state_dict: ranks passed different recipient ranks {recipients}; "
            f"every rank must pass the same recipient_rank."
        )
    receives = recipient in (-1, rank)
    device = _comm_device(group)
    gloo_direct = _receives_in_place(device)
    out: dict[int, dict[str, Any]] | None = {} if receives else None
    own_pending = out is not None and recipient != -1  # own shard still to copy

    def copy_own() -> None:
        if out is None:
            return
        for dtype, all_metas in _by_dtype(gathered[rank][1]):
            metas = list(all_metas)
            if not metas:
                continue
            host = torch.empty(sum(_numel(m[2]) for m in metas), dtype=dtype)
            off = 0
            for idx, key, shape, _, _ in metas:
                n = _numel(shape)
                view = host[off : off + n]
                view.copy_(local[idx][key].detach().reshape(-1))
                out.setdefault(idx, {})[key] = view.view(shape)
                off += n

    for src in range(world):
        _, src_tensors, src_values, _, _ = gathered[src]
        src_global = global_rank(group, src)
        if out is not None:
            for idx, vals in src_values.items():
                out.setdefault(idx, {}).update(vals)
            for idx, key, shape, dtype, skip in src_tensors:
                if skip and src == rank:
                    out[idx][key] = local[idx][key].detach().to("cpu", copy=True)
                elif skip:
                    out[idx][key] = torch.empty(shape, dtype=dtype, device="meta")
                elif _numel(shape) == 0:
                    out[idx][key] = torch.empty(shape, dtype=dtype)
        if src == rank and out is not None and recipient != -1:
            continue  # the recipient's own shard: copied by copy_own(), overlapped with a receive
        if src != rank and out is None:
            continue  # neither the source nor the recipient: nothing to do for this source
        works: list[Any] = []
        wires: list[torch.Tensor] = []  # keeps async sends' buffers alive until waited
        tag = 0  # one tag per message of this source, across dtypes
        for dtype, metas in _by_dtype(src_tensors):
            itemsize = torch.empty((), dtype=dtype).element_size()
            host: torch.Tensor | None = None
            if out is not None and (src != rank or recipient == -1):
                host = torch.empty(sum(_numel(m[2]) for m in metas), dtype=dtype)
            off = 0
            for message in _plan(metas, itemsize):
                n = sum(_numel(m[2]) for m in message)
                tag += 1
                if src == rank:
                    wire = _payload(local, message, device)
                    if recipient == -1:
                        dist.broadcast(wire, src=src_global, group=group)
                        if host is not None:
                            host[off : off + n].copy_(wire)
                    else:
                        dst = global_rank(group, recipient)
                        work = dist.isend(wire, dst=dst, group=group, tag=tag)
                        if work is not None and gloo_direct:
                            works.append(work)
                            wires.append(wire)
                        elif work is not None:
                            work.wait()  # a device wire may be a staged copy: one at a time
                elif host is not None:
                    dest = host[off : off + n]
                    if gloo_direct and recipient == -1:
                        dist.broadcast(dest, src=src_global, group=group)
                    elif gloo_direct:
                        works.append(dist.irecv(dest, src=src_global, group=group, tag=tag))
                    else:
                        stage = torch.empty(n, dtype=dtype, device=device)
                        if recipient == -1:
                            dist.broadcast(stage, src=src_global, group=group)
                        else:
                            dist.recv(stage, src=src_global, group=group, tag=tag)
                        dest.copy_(stage)
                        del stage
                off += n
            if out is not None and host is not None:
                off = 0
                for idx, key, shape, _, _ in metas:
                    k = _numel(shape)
                    out[idx][key] = host[off : off + k].view(shape)
                    off += k
        if own_pending and src != rank:
            copy_own()  # overlaps with the receives just posted
            own_pending = False
        for w in works:
            w.wait()
        del wires
    if own_pending:
        copy_own()
    if out is not None:
        # Restore each entry's key order (tensors and plain values were sent apart).
        for g in gathered:
            for idx, keys in g[3].items():
                out[idx] = {k: out[idx][k] for k in keys}
    return out, [g[4] for g in gathered]
