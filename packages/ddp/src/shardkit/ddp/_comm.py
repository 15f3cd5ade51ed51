"""The one communication layer of ``ShardedDataParallel``: every collective goes through here.

[Note: Byte accounting]
Each collective is counted at the moment it is issued, with the ring model of its volume per
rank for a buffer of ``B`` bytes over ``N`` ranks: reduce-scatter and all-gather move
``(N-1)/N * B``, all-reduce ``2(N-1)/N * B``, broadcast ``(N-1)/N * B`` (a pipelined chain,
averaged over the ranks). These are the bytes a bandwidth-optimal implementation puts on the
wire; Gloo's reduce-scatter is not bandwidth-optimal: it sends twice the ring figure (as much
as an all-reduce of the buffer), so on Gloo a step sends ~1.5x the counted bytes (measured by
``benchmarks/wire_bytes.py``, see the README). The time from issue to completion is recorded
by kind when the package waits on a work.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = ["CommStats"]

logger = logging.getLogger("shardkit.ddp")
_logged_gloo = False


@dataclass
class CommStats:
    """Counters of the collectives one ``ShardedDataParallel`` issued (this rank).

    ``bytes`` is the ring-model volume (see [Note: Byte accounting] in ``shardkit.ddp._comm``)
    by kind (``"reduce_scatter"``, ``"all_gather"``, ``"all_reduce"``, ``"broadcast"``);
    ``calls`` the number of collectives by kind; ``seconds`` the time from issue to completion
    by kind (only for works that were waited on by the package).
    """

    bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    buffer_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Plain buffer bytes (not scaled by the ring model), by kind."""

    def total_bytes(self) -> float:
        """Ring-model bytes of every kind together."""
        return float(sum(self.bytes.values()))

    def reset(self) -> None:
        """Zeroes every counter."""
        self.bytes.clear()
        self.calls.clear()
        self.seconds.clear()
        self.buffer_bytes.clear()


_RING: dict[str, Callable[[int], float]] = {
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
}

_reduce_scatter: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)
_all_gather: Callable[..., Any] = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class _Pending:
    """An issued collective: its works (one, or one per broadcast of a Gloo all-gather) and
    when it was issued."""

    __slots__ = ("kind", "start", "works")

    def __init__(self, kind: str, *works: dist.Work | None) -> None:
        self.kind = kind
        self.works = [w for w in works if w is not None]
        self.start = time.perf_counter()


class _Comm:
    """Issues and counts every collective of one ``ShardedDataParallel``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.stats = CommStats()
        self._gloo = dist.get_backend(group) == "gloo"
        self.reduces_in_place = self._gloo
        """Whether the reduce-scatter's output must be this rank's chunk of its input (Gloo:
        see [Note: Gloo reduce-scatter by reduces])."""
        self.rank = dist.get_rank(group)
        self._global_ranks = [dist.get_global_rank(group, r) for r in range(self.world)]
        global _logged_gloo
        if self._gloo and not _logged_gloo:
            _logged_gloo = True
            logger.info(
                "ShardedDataParallel on Gloo: each reduce-scatter is one in-place reduce of "
                "each rank's range to that rank and each all-gather one in-place broadcast of "
                "each rank's range from that rank, since Gloo's reduce_scatter and all_gather "
                "allocate bucket-sized buffers per call (logged once)"
            )

    def _count(self, kind: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.stats.bytes[kind] += _RING[kind](self.world) * nbytes
        self.stats.buffer_bytes[kind] += nbytes
        self.stats.calls[kind] += 1

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> _Pending:
        """Async SUM reduce-scatter of ``inp`` (``world * out.numel()``) into ``out``; with
        :attr:`reduces_in_place`, ``out`` must be this rank's chunk of ``inp``, and the other
        chunks of ``inp`` are left with unspecified values."""
        self._count("reduce_scatter", inp)
        if not self._gloo:
            work = _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            return _Pending("reduce_scatter", cast("dist.Work | None", work))
        # [Note: Gloo reduce-scatter by reduces]
        # Gloo's reduce_scatter (list form; reduce_scatter_tensor runs through it after an
        # extra full-buffer pass, 3-5x slower on CPU) copies this rank's input chunk into the
        # output, clones every other chunk, and all-reduces each of the N buffers: per call it
        # allocates (N-1)/N of the bucket on the calling thread, held until the work completes,
        # and it sends twice the ring model's bytes. Allocated while backward frees each
        # param's autograd gradient, those clones split the freed blocks, so glibc's heap
        # grows by a gradient's size per bucket (measured on the 33.6M-param model of
        # ``bench_memory.py``: 8 MiB clones landing where the 16 MiB gradients were freed, the
        # next gradient placed above them). So on Gloo the bucket is reduced in place, one
        # ``dist.reduce`` of each rank's chunk to that rank: nothing is allocated (Gloo's
        # reduce keeps a small scratch of its own), and Gloo's reduce sends fewer bytes (1.5x
        # the ring model at world 2, 1.25x at world 4, against 2.0x: ``wire_bytes.py``). The
        # owner's sum is in its own chunk of the staging buffer, which the reducer copies (or
        # adds) into the grad shard when the work completes. At world 2 the sums are the same
        # bits (two addends); with more ranks Gloo's reduce may add them in another order than
        # its all-reduce. Counted as one reduce-scatter ([Note: Byte accounting]).
        chunks = inp.chunk(self.world)
        if out.data_ptr() != chunks[self.rank].data_ptr() or out.shape != chunks[self.rank].shape:
            raise ValueError(
                "on Gloo the reduce-scatter runs in place: out must be this rank's chunk of inp"
            )
        works = [
            dist.reduce(chunk, dst=dst, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            for dst, chunk in zip(self._global_ranks, chunks, strict=True)
        ]
        return _Pending("reduce_scatter", *cast("list[dist.Work | None]", works))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _Pending:
        """Async all-gather of every rank's ``inp`` into ``out`` (``inp`` may be this rank's
        range of ``out``: in place, as the param gathers run)."""
        self._count("all_gather", out)
        if not self._gloo:
            work = _all_gather(out, inp, group=self.group, async_op=True)
            return _Pending("all_gather", cast("dist.Work | None", work))
        # [Note: Gloo all-gather by broadcasts]
        # Gloo's all_gather (list form and all_gather_into_tensor alike) receives into a flat
        # buffer it allocates per call, the size of the whole output, and copies it back into
        # the outputs: a bucket-sized allocation per bucket and step, made on Gloo's worker
        # threads, whose pages glibc keeps (measured: 8 in-flight gathers of 16 MiB buckets
        # left 64 MiB more resident per rank at world 2, and ran 2.5x slower than the
        # broadcasts, 128 ms against 45 ms). So on Gloo each rank's range is broadcast from
        # that rank, in place, into the same range of ``out`` on every other rank: no buffer,
        # no copy-back, and the same bytes (a Gloo broadcast sends its ``S`` elements to each of
        # the ``N - 1`` others, so a rank sends ``(N-1) * S`` in all, the ring all-gather's
        # ``(N-1)/N`` of the buffer; ``benchmarks/wire_bytes.py`` measures both at 1.00 of the
        # ring model). It is counted as one all-gather ([Note: Byte accounting]). NCCL
        # all-gathers in place into ``out`` with no buffer of its own, so other backends keep the
        # single collective.
        chunks = out.chunk(self.world)
        mine = chunks[self.rank]
        if not (inp.data_ptr() == mine.data_ptr() and inp.shape == mine.shape):
            mine.copy_(inp)
        works = [
            dist.broadcast(chunk, src=src, group=self.group, async_op=True)
            for src, chunk in zip(self._global_ranks, chunks, strict=True)
        ]
        return _Pending("all_gather", *cast("list[dist.Work | None]", works))

    def all_gather_into(
        self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """Blocking, counted all-gather over this wrapper's group (shardkit-optim's
        ``AllGather``, for the state dicts)."""
        if group is not self.group:
            raise ValueError("ShardedDataParallel gathers state over its own process group only")
        self.wait(self.all_gather(out, inp))

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """Blocking all-reduce (small control values: norms, flags)."""
        self._count("all_reduce", t)
        dist.all_reduce(t, op=op, group=self.group)

    def broadcast(self, t: torch.Tensor, src_group_rank: int) -> None:
        """Blocking broadcast from group rank ``src_group_rank`` (buffers, startup sync)."""
        self._count("broadcast", t)
        dist.broadcast(t, src=self._global_ranks[src_group_rank], group=self.group)

    def wait(self, pending: _Pending | None) -> None:
        """Waits for ``pending`` and records its issue-to-completion time."""
        if pending is None:
            return
        for work in pending.works:
            work.wait()
        self.stats.seconds[pending.kind] += time.perf_counter() - pending.start
