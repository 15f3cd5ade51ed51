"""The one communication layer of ``ShardedDataParallel``: every collective goes through here.

[Note: Byte accounting]
Each collective is counted at the moment it is issued, with the ring model of its volume per
rank for a buffer of ``B`` bytes over ``N`` ranks: reduce-scatter and all-gather move
``(N-1)/N * B``, all-reduce ``2(N-1)/N * B``, broadcast ``(N-1)/N * B`` (a pipelined chain,
averaged over the ranks). These are the bytes a bandwidth-optimal implementation puts on the
wire. On Gloo the reduce-scatter sends each chunk to its owner point to point ([Note: Gloo
reduce-scatter point to point]), exactly the ring figure (Gloo's own reduce-scatter sends twice
it), and the all-gather is one broadcast per rank ([Note: Gloo all-gather by broadcasts]); what
Gloo sends is measured by ``benchmarks/wire_bytes.py`` (the README). The time from issue to
completion is recorded by kind when the package waits on a work.
"""

from __future__ import annotations

import functools
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
    """An issued collective: its works (one per c10d call it took), what completes it once they
    are done (``finish``: the local sum of what was received), and when it was issued."""

    __slots__ = ("finish", "kind", "start", "works")

    def __init__(
        self, kind: str, works: list[dist.Work], finish: Callable[[], None] | None = None
    ) -> None:
        self.kind = kind
        self.works = works
        self.finish = finish
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
        # [Note: Gloo collectives]
        # Gloo's collectives that take a bucket allocate inside Gloo, per call, except
        # all-reduce, broadcast, point-to-point sends and receives and an all-to-all into a given
        # buffer (peak resident beyond the input and output, VmHWM around one call after
        # ``malloc_trim``, world 2 and 4: ``reduce_scatter_tensor`` +1.00x the buffer, its list
        # form +0.56x to +0.78x (it clones the chunks the rank does not own), ``all_gather`` and
        # ``all_gather_into_tensor`` +1.00x (a temporary of the whole output); the README's
        # table). Blocks of bucket size freed on Gloo's threads and asked for again on others
        # stay resident on CPU. So on Gloo a step's two collectives are built from those that
        # allocate nothing (the two notes below); NCCL, what GPU users run, reduce-scatters and
        # all-gathers in place with no buffer of its own and gets ``reduce_scatter_tensor`` /
        # ``all_gather_into_tensor``.
        #
        # [Note: Gloo reduce-scatter point to point]
        # On Gloo the reduce-scatter sends the chunk of every other rank to it and receives
        # that rank's contribution to this rank's chunk (one ``batch_isend_irecv`` of async
        # sends and receives, posted in rank order on every rank, so they pair up), into a
        # receive buffer of this layer's own of ``(N-1)/N`` of the bucket; when the works are
        # done the received chunks are added, in rank order, to this rank's own chunk of the
        # input, into the output. Nothing is allocated inside Gloo, each rank sends the ring's
        # ``(N-1)/N`` of the bucket (Gloo's reduce-scatter sends twice that), and it runs
        # 1.7-2.3x faster than Gloo's reduce-scatter on CPU (the README's figures). The receive
        # buffers are a pool of the bucket layout: one per reduce-scatter in flight (the staging
        # pool bounds those), of the largest bucket's size, kept with the staging pool
        # ([Note: Staging lifetime] in ``shardkit.optim._reducer``). Two chunks sum to the same
        # bits in either order, so at world 2 the gradients equal DDP's all-reduce bit for bit.
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
        self._recv_size: dict[tuple[torch.dtype, torch.device], int] = {}
        self._recv_free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._recv_bytes = 0
        global _logged_gloo
        if self.gloo and not _logged_gloo:
            _logged_gloo = True
            logger.info(
                "ShardedDataParallel on Gloo: reduce-scatters with point-to-point sends and "
                "receives into a buffer of its own and a local sum, all-gathers with one "
                "broadcast per rank in place (Gloo's reduce-scatter and all-gather allocate "
                "inside Gloo on every call; see [Note: Gloo collectives] in "
                "shardkit.optim._comm); logged once"
            )

    def _count(self, kind: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.stats.bytes[kind] += _RING[kind](self.world) * nbytes
        self.stats.buffer_bytes[kind] += nbytes
        self.stats.calls[kind] += 1

    def reserve_receive(
        self, dtype: torch.dtype, device: torch.device, numel: int, count: int = 0
    ) -> None:
        """Sizes the receive buffers of [Note: Gloo reduce-scatter point to point] for inputs
        of up to ``numel`` elements of ``dtype`` on ``device`` (each bucket of a new layout)
        and allocates ``count`` of them now if fewer exist (a kept pool); idle buffers of a
        smaller size are dropped. Nothing on other backends."""
        if not self.gloo:
            return
        key = (dtype, device)
        need = numel - numel // self.world
        free = self._recv_free.setdefault(key, [])
        if need > self._recv_size.setdefault(key, 0):
            self._recv_size[key] = need
            self._drop_smaller(free, need)
        while len(free) < count:
            base = torch.empty(self._recv_size[key], dtype=dtype, device=device)
            self._recv_bytes += base.numel() * base.element_size()
            free.append(base)

    def release_receive(self) -> None:
        """Frees the idle receive buffers (with the staging pool, when it is not kept)."""
        for free in self._recv_free.values():
            self._recv_bytes -= sum(b.numel() * b.element_size() for b in free)
            free.clear()

    def receive_bytes(self) -> int:
        """Bytes of the receive buffers that exist now, idle or in use."""
        return self._recv_bytes

    def _take_receive(self, dtype: torch.dtype, device: torch.device, n: int) -> torch.Tensor:
        key = (dtype, device)
        size = max(self._recv_size.get(key, 0), n)
        self._recv_size[key] = size
        free = self._recv_free.setdefault(key, [])
        self._drop_smaller(free, n)
        if free:
            return free.pop()
        base = torch.empty(size, dtype=dtype, device=device)
        self._recv_bytes += base.numel() * base.element_size()
        return base

    def _drop_smaller(self, free: list[torch.Tensor], n: int) -> None:
        """Frees the idle receive buffers of fewer than ``n`` elements."""
        for base in [b for b in free if b.numel() < n]:
            free.remove(base)
            self._recv_bytes -= base.numel() * base.element_size()

    def _add_received(
        self, out: torch.Tensor, own: torch.Tensor, base: torch.Tensor, shard: int
    ) -> None:
        if out.data_ptr() != own.data_ptr():
            out.copy_(own)
        for j in range(self.world - 1):
            out.add_(base[j * shard : (j + 1) * shard])
        self._recv_free.setdefault((base.dtype, base.device), []).append(base)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> _Pending:
        """Async SUM reduce-scatter of ``inp`` (``world * out.numel()``) into ``out``, which may
        be this rank's chunk of ``inp`` (in place)."""
        self._count("reduce_scatter", inp)
        if self.gloo:  # See [Note: Gloo reduce-scatter point to point]
            shard = inp.numel() // self.world
            own = inp[self.rank * shard : (self.rank + 1) * shard]
            base = self._take_receive(inp.dtype, inp.device, (self.world - 1) * shard)
            finish = functools.partial(self._add_received, out, own, base, shard)
            if self.world == 1:
                return _Pending("reduce_scatter", [], finish)
            ops: list[dist.P2POp] = []
            j = 0
            for r in range(self.world):
                if r == self.rank:
                    continue
                peer, mine = self.global_ranks[r], base[j * shard : (j + 1) * shard]
                theirs = inp[r * shard : (r + 1) * shard]
                ops.append(dist.P2POp(dist.isend, theirs, peer, self.group))
                ops.append(dist.P2POp(dist.irecv, mine, peer, self.group))
                j += 1
            works = dist.batch_isend_irecv(ops)
            return _Pending("reduce_scatter", list(works), finish)
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
        if pending.finish is not None:
            finish, pending.finish = pending.finish, None
            finish()
        self.stats.seconds[pending.kind] += time.perf_counter() - pending.start


def _works(work: object) -> list[dist.Work]:
    """The work of an ``async_op=True`` c10d call, as a list (empty if it returned none)."""
    return [] if work is None else [cast("dist.Work", work)]
