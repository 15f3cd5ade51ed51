"""Parameter synchronisation after the local step: one broadcast per (device, dtype, owner) bucket.

Entry point for shardkit-overlap: ``_ParamSync.sync(params=None, async_op=False)`` broadcasts
either everything or exactly the given params (one collective per contiguous run of them in a
flat buffer), so a comm hook can sync one DDP bucket's worth of parameters at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from shardkit.buckets import ParamBucket
from shardkit.optim._dist import global_rank
from shardkit.optim._driver import ShardLayout

__all__: list[str] = []

logger = logging.getLogger("shardkit.optim")
_logged_reattach = False


# [Note: Flat param buckets]
# At (re)partition time every trainable parameter is moved into the flat buffer of a
# ``shardkit.buckets.ParamBucket`` keyed by (device, dtype, owner): ``add_param`` copies its value
# in and makes ``p.data`` a view of the buffer. The owner's local optimizer updates the params
# in place, i.e. it writes straight into the buffer, and the sync is then a single broadcast of
# the buffer from the owner per key, instead of one per parameter. The parameters stay the same
# ``Parameter`` objects (DDP hooks, user references keep working). Frozen parameters are not in any
# bucket (nothing changes them); when a layout is rebuilt, parameters leaving a bucket get a
# private copy so the old flat buffer can be freed.


# [Note: Exact sync spans]
# ``sync(params)`` broadcasts exactly the given params and nothing else: they are grouped by flat
# buffer, sorted by offset, and each maximal run of adjacent ones is one broadcast. Widening a run
# to cover params that were not asked for would race: a comm hook syncs bucket ``b`` while the
# owner may still be stepping (writing) params of bucket ``b + 1`` in the same buffer, and Gloo
# may run two async broadcasts into one region on different worker threads in either order. With
# the buffers laid out by DDP bucket ([Note: Imposed partition]) a bucket is one run per owner.


@dataclass
class _Bucket:
    owner: int
    bucket: ParamBucket
    index: int
    # id(param) -> (offset, numel) inside ``bucket.buffer``
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    params: list[torch.Tensor] = field(default_factory=list)


class _ParamSync:
    """Owns the flat buckets of one layout and broadcasts them from their owners."""

    def __init__(
        self, layout: ShardLayout, group: dist.ProcessGroup, rank: int, broadcast_fp16: bool
    ) -> None:
        self._group = group
        self._rank = rank
        self._broadcast_fp16 = broadcast_fp16
        self._world_size = dist.get_world_size(group)
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        if self._world_size == 1:
            return
        keyed: dict[tuple[str, str, int], list[torch.Tensor]] = {}
        for i in layout.order or range(len(layout.params)):
            p = layout.params[i]
            if not layout.trainable[i]:
                continue
            key = (str(p.device), str(p.dtype), layout.owner[i])
            keyed.setdefault(key, []).append(p)
        for key in sorted(keyed, key=lambda k: (k[0], k[1], k[2])):
            params = keyed[key]
            size = sum(p.numel() for p in params)
            pb = ParamBucket(size, params[0].dtype, params[0].device)
            entry = _Bucket(owner=key[2], bucket=pb, index=len(self.buckets))
            offset = 0
            for p in params:
                pb.add_param(p)
                entry.spans[id(p)] = (offset, p.numel())
                entry.params.append(p)
                self._bucket_of[id(p)] = entry
                offset += p.numel()
            self.buckets.append(entry)

    # [Note: Params moved off their buckets]
    # ``module.to(device)`` with a device that compares unequal to the params' own (Accelerate
    # prepares CPU models with ``.to("cpu:0")``, and ``cpu:0 != cpu`` for torch) copies every
    # param and rebinds its ``.data``: the params are no longer views of the flat buffers, so the
    # local step writes into the copies and the sync broadcasts the stale buffers. Each
    # ``step()`` therefore checks the first param of every bucket (O(buckets), not O(params):
    # such a move rebinds them all) and re-attaches the bucket's params, their current values
    # kept, logging it once.
    def reattach_moved(self) -> int:
        """Re-attaches the buckets whose params were rebound; returns how many."""
        global _logged_reattach
        moved = 0
        for entry in self.buckets:
            first = entry.params[0]
            buffer = entry.bucket.buffer
            if (
                first.device == buffer.device
                and first.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            ):
                continue
            entry.bucket.reattach()
            moved += 1
        if moved and not _logged_reattach:
            _logged_reattach = True
            logger.warning(
                "the params of %d flat bucket(s) of a ShardedOptimizer were given new storage "
                "since it was built (e.g. module.to(device) with a device that copies, such as "
                "Accelerate's 'cpu:0'); re-attached them to the buckets, keeping their current "
                "values (logged once; move the model before building the optimizer to avoid "
                "the copy)",
                moved,
            )
        return moved

    def release(self, keep: Iterable[torch.Tensor]) -> None:
        """Gives params that are not in ``keep`` their own storage, freeing the flat buffers."""
        kept = {id(p) for p in keep}
        for entry in self.buckets:
            for p in entry.params:
                if id(p) not in kept:
                    p.data = p.data.clone()
        self.buckets = []
        self._bucket_of = {}

    def drop(self) -> None:
        """Forgets the flat buffers without touching the params (a ``ShardOwner`` re-pointed
        them into its own buffers: see [Note: Step drivers]), so the buffers can be freed."""
        self.buckets = []
        self._bucket_of = {}

    def sync(
        self, params: Iterable[torch.Tensor] | None = None, async_op: bool = False
    ) -> list[dist.Work]:
        """Broadcasts the owners' values. See [Note: Flat param buckets].

        Args:
            params: exactly these params, one broadcast per contiguous run of them in a flat
                buffer (see [Note: Exact sync spans]); frozen ones are ignored. ``None`` syncs
                everything. Every rank must pass the same params.
            async_op: return the pending works instead of waiting (fp16 broadcasts always
                complete before returning, since the received values must be copied back).
        """
        if self._world_size == 1:
            return []
        spans: list[tuple[_Bucket, int, int]] = []
        if params is None:
            spans = [(b, 0, b.bucket.buffer.numel()) for b in self.buckets]
        else:
            pieces: list[tuple[int, int, int]] = []
            for p in params:
                entry = self._bucket_of.get(id(p))
                if entry is not None:
                    off, n = entry.spans[id(p)]
                    pieces.append((entry.index, off, off + n))
            pieces.sort()
            for bi, lo, hi in pieces:
                last = spans[-1] if spans else None
                if last is not None and last[0].index == bi and last[2] == lo:
                    spans[-1] = (last[0], last[1], hi)
                elif last is not None and last[0].index == bi and lo < last[2]:
                    continue  # the same param given twice
                else:
                    spans.append((self.buckets[bi], lo, hi))
        works: list[dist.Work] = []
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        for entry, lo, hi in spans:
            view = entry.bucket.buffer[lo:hi]
            src = global_rank(self._group, entry.owner)
            if self._broadcast_fp16 and view.dtype in (torch.float32, torch.float64):
                # The owner sends a rounded copy but keeps its exact values; receivers copy the
                # rounded values into their full-precision buffer.
                wire = view.to(torch.float16)
                work = dist.broadcast(wire, src=src, group=self._group, async_op=True)
                if entry.owner != self._rank:
                    pending.append((view, wire))
                works.append(_checked(work))
                continue
            works.append(_checked(dist.broadcast(view, src=src, group=self._group, async_op=True)))
        if pending or not async_op:
            for w in works:
                w.wait()
            for view, wire in pending:
                view.copy_(wire)
            return []
        return works


def _checked(work: dist.Work | None) -> dist.Work:
    if work is None:
        raise RuntimeError("an async broadcast returned no work handle")
    return work
