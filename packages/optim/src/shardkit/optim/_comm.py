"""The one communication layer of ``ShardedDataParallel``: every collective goes through here.

[Note: Byte accounting]
Each collective is counted at the moment it is issued, with the ring model of its volume per
rank for a buffer of ``B`` bytes over ``N`` ranks: reduce-scatter and all-gather move
``(N-1)/N * B``, all-reduce ``2(N-1)/N * B``, broadcast ``(N-1)/N * B`` (a pipelined chain,
averaged over the ranks). These are the bytes a bandwidth-optimal implementation puts on the
wire; Gloo's reduce-scatter is not bandwidth-optimal: it sends twice the ring figure (as much
as an all-reduce of the buffer), so on Gloo a step sends more than the counted bytes (measured by
``benchmarks/wire_bytes.py``, see the README). The time from issue to completion is recorded
by kind when the package waits on a work.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from shardkit.optim._dist import global_rank
from shardkit.optim._torch_compat import all_gather_single, reduce_scatter_single

__all__ = ["CommStats"]

logger = logging.getLogger("shardkit.optim")
_logged_gloo = False


@dataclass
class CommStats:
    """Counters of the collectives one ``ShardedDataParallel`` issued (this rank).

    ``bytes`` is the ring-model volume (see [Note: Byte accounting] in ``shardkit.optim._comm``)
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


class _Pending:
    """An issued collective: its works (one per c10d call it took) and when it was issued."""

    __slots__ = ("kind", "start", "works")

    def __init__(self, kind: str, works: list[dist.Work]) -> None:
        self.kind = kind
        self.works = works
        self.start = time.perf_counter()

    def done(self) -> bool:
        """Whether every work has completed (nothing left to wait for)."""
        return all(w.is_completed() for w in self.works)


class _Comm:
    """Issues and counts every collective of one ``ShardedDataParallel``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_ranks = [global_rank(group, r) for r in range(self.world)]
        """The global rank of each group rank (broadcast sources)."""
        self.stats = CommStats()
        # [Note: Gloo list collectives]
        # Gloo implements reduce_scatter_tensor / all_gather_into_tensor through an extra
        # full-buffer pass, several times slower than its list forms on CPU (the README's
        # figures); the list forms take views of the same buffer. Same bytes, same sums. Both
        # forms allocate inside Gloo, per call: its reduce-scatter clones the ``N - 1`` chunks
        # of the input it does not own and its all-gather receives into a buffer of the whole
        # output, then copies back (what that does to resident memory on CPU: the README's
        # memory section).
        # That is Gloo's, and stays for the reduce-scatter: NCCL, what GPU users run,
        # reduce-scatters and all-gathers in place with no buffer of its own.
        #
        # [Note: Gloo all-gather by broadcasts]
        # On Gloo the all-gather is one async broadcast per rank of that rank's chunk, in place
        # in the output: nothing allocated inside Gloo (its all-gather, list form or not,
        # receives into a temporary of the whole output: +1.00x the buffer's bytes of peak
        # resident per call, measured with VmHWM around one call at world 2 and 4), the same
        # bytes per rank as the ring's (N-1)/N, and 2.7-4x faster on CPU (the README's
        # figures). Every rank issues the broadcasts in rank order, so they pair up.
        self.gloo = dist.get_backend(group) == "gloo"
        """Whether the group is Gloo's (its collectives run on worker threads of its own)."""
        self._lists = self.gloo
        global _logged_gloo
        if self._lists and not _logged_gloo:
            _logged_gloo = True
            logger.info(
                "ShardedDataParallel on Gloo: reduce-scatters with the list form of "
                "reduce_scatter (views of the bucket; reduce_scatter_tensor runs 3-5x slower "
                "on CPU) and all-gathers with one broadcast per rank, in place (Gloo's "
                "all-gathers receive into a temporary of the whole output); logged once"
            )

    def _count(self, kind: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.stats.bytes[kind] += _RING[kind](self.world) * nbytes
        self.stats.buffer_bytes[kind] += nbytes
        self.stats.calls[kind] += 1

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> _Pending:
        """Async SUM reduce-scatter of ``inp`` (``world * out.numel()``) into ``out``, which may
        be this rank's chunk of ``inp`` (in place)."""
        self._count("reduce_scatter", inp)
        if self._lists:
            chunks = list(inp.chunk(self.world))
            work = dist.reduce_scatter(
                out, chunks, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
        else:
            work = reduce_scatter_single(
                out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
        return _Pending("reduce_scatter", _works(work))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _Pending:
        """Async all-gather of every rank's ``inp`` into ``out`` (``inp`` may be this rank's
        range of ``out``: in place, as the param gathers run)."""
        self._count("all_gather", out)
        if self.gloo:  # See [Note: Gloo all-gather by broadcasts]
            chunks = out.chunk(self.world)
            mine = chunks[self.rank]
            if not (mine.data_ptr() == inp.data_ptr() and mine.shape == inp.shape):
                mine.copy_(inp)
            works = [
                dist.broadcast(c, src=self.global_ranks[r], group=self.group, async_op=True)
                for r, c in enumerate(chunks)
            ]
            return _Pending("all_gather", [w for w in works if w is not None])
        work = all_gather_single(out, inp, group=self.group, async_op=True)
        return _Pending("all_gather", _works(work))

    def all_gather_into(
        self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """Blocking, counted all-gather over this wrapper's group (shardkit-optim's
        ``AllGather``, for the state dicts)."""
        if group is not self.group:
            raise ValueError("ShardedDataParallel gathers state over its own process group only")
        self.wait(self.all_gather(out, inp))

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """Blocking all-reduce (small control values: the usage mask)."""
        self._count("all_reduce", t)
        dist.all_reduce(t, op=op, group=self.group)

    def broadcast(self, t: torch.Tensor, src_group_rank: int) -> None:
        """Blocking broadcast from group rank ``src_group_rank`` (buffers, startup sync)."""
        self._count("broadcast", t)
        dist.broadcast(t, src=self.global_ranks[src_group_rank], group=self.group)

    def wait(self, pending: _Pending | None) -> None:
        """Waits for ``pending`` and records its issue-to-completion time."""
        if pending is None:
            return
        for work in pending.works:
            work.wait()
        self.stats.seconds[pending.kind] += time.perf_counter() - pending.start


def _works(work: object) -> list[dist.Work]:
    """The work of an ``async_op=True`` c10d call, as a list (empty if it returned none)."""
    return [] if work is None else [cast("dist.Work", work)]
