"""The wire layer of ``ShardedDataParallel``: every collective goes through here.

Each bucket collective takes a codec: :class:`Exact` (the bucket's own dtype, or the
``reduce_dtype`` it is staged in; the collective sums) or a block format of
``shardkit.optim._codecs`` (int8 / int4: [Note: Quantized reduce-scatter], [Note: Weight
deltas]). The wire owns every buffer its collectives need beside the bucket's own (receive
buffers, encoded send and receive buffers, the codec scratch: [Note: Wire buffers]) and
counts every byte, by kind and by bucket ([Note: Byte accounting]).

[Note: Byte accounting]
Each collective is counted at the moment it is issued, with the ring model of its volume per
rank for a buffer of ``B`` bytes over ``N`` ranks: reduce-scatter, all-gather and all-to-all
move ``(N-1)/N * B``, all-reduce ``2(N-1)/N * B``, broadcast ``(N-1)/N * B`` (a pipelined chain,
averaged over the ranks). ``B`` is what travels: the bucket in its wire dtype, or its encoded
bytes, scales included (counted apart too, ``CommStats.scale_bytes``). These are the bytes a
bandwidth-optimal implementation puts on the wire. On Gloo the reduce-scatter sends each chunk
to its owner point to point ([Note: Gloo reduce-scatter point to point]), exactly the ring
figure (Gloo's own reduce-scatter sends twice it), and the all-gather is one broadcast per rank
([Note: Gloo all-gather by broadcasts]); what Gloo sends is measured by
``benchmarks/wire_bytes.py`` (the README). The time from issue to completion is recorded by
kind when the package waits on a work.

[Note: Quantized reduce-scatter]
With a block format for gradients (``ShardedDataParallel(wire="int8")``) a bucket's
reduce-scatter is one all-to-all of encoded chunks: each rank encodes the ``N - 1`` chunks of
its staged bucket that other ranks own ([Note: Block quantization on the wire] in
``shardkit.optim._codecs``) into a send buffer of the wire's, ``all_to_all_single`` moves them
into a receive buffer of the same size (on Gloo and NCCL alike: Gloo's all-to-all into a given
buffer allocates nothing), and when it completes the owner sums its chunk in fp32, in rank
order: its own contribution exact (it never travels), every other one decoded; the sum is
written (or, when the shard holds an unconsumed gradient, added) into the grad shard. So each
element is quantized once, by its sender, the sum is the same on every run, and a rank's
shard does not depend on the order messages arrive in. The wire's bytes per rank are
``(N-1)/N`` of the encoded bucket: 0.254x (int8) and 0.141x (int4) of an fp32 reduce-scatter.

[Note: Weight deltas]
With a block format for params (``wire_params``, by default ``wire``'s) the param all-gather
moves quantized *differences*: every rank's replica of the params is the same; the owner of a
shard keeps the exact values (a master, ``MasterSet`` of ``_master_set.py`` in replica mode,
the step does not write the replica) and, after its step, encodes ``exact - replica`` of its
shard into its chunk of a receive buffer of the wire's; the encoded chunks are all-gathered in
place (Gloo: one broadcast per rank; NCCL: ``all_gather_into_tensor``), and every rank, the
owner included, adds each decoded chunk to its replica of that chunk (fp32 decode, added in the
params' dtype). The replicas therefore stay bit-identical across ranks, and since the next
step's difference is taken against the replica, the rounding error of one step is carried into
the next (error feedback with no buffer of its own). The masters cost ``4/N`` bytes per param
for fp32 params (bf16 params with ``master_dtype`` have them already).

[Note: Wire buffers]
The wire's buffers come from one pool, by role, dtype and device, sized from the bucket layout
(``reserve``) and reused every step: Gloo's receive buffers of ``(N-2)/N`` of the largest
bucket (exact codecs; none at world 2: one peer's chunk is received into the grad shard);
encoded send and receive buffers of the largest bucket (block codecs; two per reduce-scatter in
flight, at most two in flight: the staging pool bounds them, [Note: Staging lifetime] in
``shardkit.optim._reducer``); one per weight-delta gather in flight, at
most :data:`MAX_DELTA_GATHERS` (issuing another first waits for the oldest); the fp32
differences of a shard, in an idle staging buffer (the step is over when the gathers are issued;
a buffer of their own only when the staging pool is not kept); the codecs' fp32 scratch of two
pieces (``_codecs.PIECE``: 2 MiB) per device; and the backward pass's staging buffers (two of the
largest bucket per wire dtype and device, in one block, lent to the step as its scratch: [Note:
Staging lifetime] in ``shardkit.optim._reducer``). So one pool holds every buffer of the
collectives and of the step, sized from the layout: two staging buffers, plus on Gloo with the
exact wire two receive buffers of ``(N-2)/N`` of the largest bucket, or with int8 gradients and
deltas at most six encoded buffers of about ``0.254x`` the largest bucket's fp32 bytes (int4:
``0.141x``), and the 2 MiB scratch. ``pool_bytes()`` reports what exists; idle buffers are
freed after each step when the staging pool is not kept.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from shardkit.optim._codecs import PIECE, BlockFormat, decode, decode_add, encode
from shardkit.optim._dist import global_rank
from shardkit.optim._torch_compat import (
    all_gather_single,
    no_function_modes,
    reduce_scatter_single,
)

__all__ = ["MAX_DELTA_GATHERS", "Codec", "CommStats", "Exact", "Wire"]

logger = logging.getLogger("shardkit.optim")
_logged_gloo = False

MAX_DELTA_GATHERS = 2
"""Weight-delta gathers in flight at once ([Note: Wire buffers])."""


@dataclass(frozen=True)
class Exact:
    """The exact codec: values travel in ``dtype`` (``None``: the bucket's own) and the
    collective sums them (see [Note: Reduce dtype] in ``shardkit.optim._reducer``)."""

    dtype: torch.dtype | None = None
    """The wire dtype, or ``None`` for each bucket's own."""

    @property
    def name(self) -> str:
        """``"exact"``, or the reduce dtype's name."""
        return "exact" if self.dtype is None else str(self.dtype).removeprefix("torch.")


Codec = Exact | BlockFormat
"""What a bucket collective takes: :class:`Exact` or a block format."""


@dataclass
class CommStats:
    """Counters of the collectives one ``ShardedDataParallel`` issued (this rank).

    ``bytes`` is the ring-model volume (see [Note: Byte accounting] in ``shardkit.optim._wire``)
    by kind (``"reduce_scatter"``, ``"all_gather"``, ``"all_reduce"``, ``"broadcast"``);
    ``calls`` the number of collectives by kind; ``seconds`` the time from issue to completion
    by kind (only for works that were waited on by the package).
    """

    bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    buffer_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Plain buffer bytes (not scaled by the ring model), by kind."""
    bucket_bytes: dict[tuple[str, int], float] = field(default_factory=lambda: defaultdict(float))
    """Ring-model bytes by (kind, bucket index), for the bucket collectives."""
    scale_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Ring-model bytes of block scales, by kind (included in ``bytes``)."""

    def total_bytes(self) -> float:
        """Ring-model bytes of every kind together."""
        return float(sum(self.bytes.values()))

    def reset(self) -> None:
        """Zeroes every counter."""
        self.bytes.clear()
        self.calls.clear()
        self.seconds.clear()
        self.buffer_bytes.clear()
        self.bucket_bytes.clear()
        self.scale_bytes.clear()


_RING: dict[str, Callable[[int], float]] = {
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
}


class _Pending:
    """An issued collective: its works (one per c10d call it took), what completes it once they
    are done (``finish``: the local sum or decode of what was received), and when it was
    issued."""

    __slots__ = ("finish", "kind", "start", "waited", "works")

    def __init__(
        self, kind: str, works: list[dist.Work], finish: Callable[[], None] | None = None
    ) -> None:
        self.kind = kind
        self.works = works
        self.finish = finish
        self.start = time.perf_counter()
        self.waited = False

    def done(self) -> bool:
        """Whether every work has completed (nothing left to wait for)."""
        return all(w.is_completed() for w in self.works)


_Key = tuple[str, torch.dtype, torch.device]
"""A pool buffer's (role, dtype, device)."""


class Wire:
    """Issues, encodes and counts every collective of one ``ShardedDataParallel``.

    Args:
        group: The process group.
        seed: Seeds the generator of stochastic rounding (offset by the rank).
    """

    def __init__(self, group: dist.ProcessGroup, seed: int = 0) -> None:
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
        # sends and receives, posted in rank order on every rank, so they pair up); when the
        # works are done the received chunks are added, in rank order, to this rank's own
        # chunk of the input, into the output. The first peer's chunk is received into the
        # grad shard itself when that holds nothing to keep (the shard has the wire's dtype and
        # no unconsumed gradient: the usual case), the others into a receive buffer of this
        # layer's own of ``(N-2)/N`` of the bucket (``(N-1)/N`` when the shard is not free);
        # the sum is then ``(first + own) + second + ...``, the same bits as ``(own + first) +
        # ...`` (one addition commutes). So at world 2 the reduce-scatter needs no buffer of
        # its own. Nothing is allocated inside Gloo, each rank sends the ring's ``(N-1)/N`` of
        # the bucket (Gloo's reduce-scatter sends twice that), and it runs 1.7-2.3x faster
        # than Gloo's reduce-scatter on CPU (the README's figures). The receive buffers are a
        # pool of the bucket layout: one per reduce-scatter in flight (the staging pool bounds
        # those), of the largest bucket's size, kept with the staging pool ([Note: Staging
        # lifetime] in ``shardkit.optim._reducer``); a reduction into a shard that is not free
        # (a second synchronised backward before ``step()``) takes the larger size once and
        # keeps it. Two chunks sum to the same bits in either order, so at world 2 the
        # gradients equal DDP's all-reduce bit for bit. Gloo's point-to-point calls take CPU
        # tensors only (a CUDA tensor's address fails in the socket write: "Bad address"), so
        # CUDA tensors on Gloo (ranks sharing a GPU, a test setup) take Gloo's list-form
        # reduce-scatter, which stages through host memory; GPU users run NCCL, whose
        # ``reduce_scatter_tensor`` reduces in place with no buffer of its own.
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
        self._size: dict[_Key, int] = {}
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._live: dict[_Key, int] = {}
        self._receive_full: dict[_Key, tuple[int, int]] = {}
        """Per receive key: the ``(N-1)/N`` size and the count a reduction into a grad shard
        that is not free needs, allocated at the first such reduction ([Note: Gloo
        reduce-scatter point to point])."""
        self._bytes = 0
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seed = seed
        self._deltas: deque[_Pending] = deque()
        """The weight-delta gathers holding a receive buffer, oldest first."""
        global _logged_gloo
        if self.gloo and not _logged_gloo:
            _logged_gloo = True
            logger.info(
                "ShardedDataParallel on Gloo: reduce-scatters with point-to-point sends and "
                "receives into a buffer of its own and a local sum, all-gathers with one "
                "broadcast per rank in place (Gloo's reduce-scatter and all-gather allocate "
                "inside Gloo on every call; see [Note: Gloo collectives] in "
                "shardkit.optim._wire); logged once"
            )

    def _count(self, kind: str, nbytes: int, bucket: int | None, scales: int = 0) -> None:
        ring = _RING[kind](self.world)
        self.stats.bytes[kind] += ring * nbytes
        self.stats.buffer_bytes[kind] += nbytes
        self.stats.calls[kind] += 1
        if bucket is not None:
            self.stats.bucket_bytes[(kind, bucket)] += ring * nbytes
        if scales:
            self.stats.scale_bytes[kind] += ring * scales

    # ------------------------------------------------------------------ buffers
    def reserve(self, codec: Codec, dtype: torch.dtype, device: torch.device, numel: int,
                count: int = 0, into_shard: bool = True) -> None:  # fmt: skip
        """Sizes the buffers a reduce-scatter of a bucket of ``numel`` elements of ``dtype``
        through ``codec`` needs ([Note: Wire buffers]), and allocates them for ``count``
        reduce-scatters in flight now if fewer exist (a kept pool); idle buffers of a smaller
        size are dropped. ``into_shard``: the grad shard has the wire's dtype, so on Gloo one
        peer's contribution is received into it ([Note: Gloo reduce-scatter point to
        point])."""
        if isinstance(codec, BlockFormat):
            n = self.world * codec.nbytes(-(-numel // self.world))
            self._reserve(("encoded", torch.uint8, device), n, 2 * count)
            self._reserve(("sum", torch.float32, device), numel // self.world, 0)
            self.scratch(device)
        elif self._point_to_point(device) and self.world > 1:
            # See [Note: Gloo reduce-scatter point to point]
            key: _Key = ("receive", dtype, device)
            full, most = self._receive_full.get(key, (0, 0))
            full = max(full, (self.world - 1) * (numel // self.world))
            self._receive_full[key] = (full, max(most, count))
            chunks = self.world - 1 - int(into_shard)
            if chunks:
                self._reserve(key, chunks * (numel // self.world), count)

    def reserve_deltas(self, fmt: BlockFormat, device: torch.device, numel: int) -> None:
        """Sizes the buffers of a weight-delta gather of a bucket of ``numel`` elements
        ([Note: Weight deltas])."""
        self._reserve(
            ("encoded", torch.uint8, device), self.world * fmt.nbytes(numel // self.world)
        )
        self.scratch(device)

    def _reserve(self, key: _Key, numel: int, count: int = 0) -> None:
        free = self._free.setdefault(key, [])
        if numel > self._size.setdefault(key, 0):
            self._size[key] = numel
            self._drop_smaller(key, numel)
        while len(free) < count:
            free.append(self._new(key, self._size[key]))

    def reserve_staging(
        self, dtype: torch.dtype, device: torch.device, numel: int, count: int
    ) -> None:
        """Sizes the staging buffers of ``dtype`` on ``device`` (``numel`` elements each, the
        backward pass's: [Note: Staging lifetime] in ``shardkit.optim._reducer``) and, if
        ``count``, allocates that many now as views of one block (kept out of the heap the
        per-step gradients churn through)."""
        key: _Key = ("staging", dtype, device)
        free = self._free.setdefault(key, [])
        self._size[key] = numel
        self._drop_smaller(key, numel)
        if count > self._live.get(key, 0):
            more = count - self._live.get(key, 0)
            block = torch.empty(more * numel, dtype=dtype, device=device)
            self._bytes += block.nbytes
            self._live[key] = count
            free.extend(block[k * numel : (k + 1) * numel] for k in range(more))

    def _new(self, key: _Key, numel: int) -> torch.Tensor:
        base = torch.empty(numel, dtype=key[1], device=key[2])
        self._bytes += base.nbytes
        self._live[key] = self._live.get(key, 0) + 1
        return base

    def release(self) -> None:
        """Frees the idle pool buffers (when the staging pool is not kept, and with each new
        bucket layout)."""
        for key, free in self._free.items():
            self._bytes -= sum(b.nbytes for b in free)
            self._live[key] = self._live.get(key, 0) - len(free)
            free.clear()

    def pool_bytes(self) -> int:
        """Bytes of the pool's buffers that exist now, idle or in use, the codec scratch
        included ([Note: Wire buffers])."""
        return self._bytes + sum(s.nbytes for s in self._scratch.values())

    def take(self, key: _Key, n: int) -> torch.Tensor:
        """An idle buffer of ``key`` of at least ``n`` elements (of the role's size), or a new
        one."""
        size = max(self._size.get(key, 0), n)
        self._size[key] = size
        free = self._free.setdefault(key, [])
        self._drop_smaller(key, n)
        return free.pop() if free else self._new(key, size)

    def give(self, key: _Key, base: torch.Tensor) -> None:
        """Returns ``base`` (taken with :meth:`take`) to the pool."""
        self._free.setdefault(key, []).append(base)

    def live(self, key: _Key) -> int:
        """Buffers of ``key`` that exist now, idle or in use."""
        return self._live.get(key, 0)

    def has_idle(self, key: _Key) -> bool:
        """Whether an idle buffer of ``key`` exists."""
        return bool(self._free.get(key))

    def idle(self, role: str) -> list[torch.Tensor]:
        """The idle buffers of ``role`` (valid until someone takes them)."""
        return [buf for key, free in self._free.items() if key[0] == role for buf in free]

    def _idle_staging(self, device: torch.device, nbytes: int) -> torch.Tensor | None:
        """An idle staging buffer on ``device`` of at least ``nbytes``, viewed as fp32 (it stays
        in the pool: the caller uses it before anything else can take it), or ``None``."""
        for buf in self.idle("staging"):
            if buf.device == device and buf.nbytes >= nbytes and buf.is_contiguous():
                return buf.view(torch.uint8)[: nbytes - nbytes % 4].view(torch.float32)
        return None

    def _drop_smaller(self, key: _Key, n: int) -> None:
        """Frees the idle buffers of ``key`` of fewer than ``n`` elements."""
        free = self._free.setdefault(key, [])
        for base in [b for b in free if b.numel() < n]:
            free.remove(base)
            self._bytes -= base.nbytes
            self._live[key] -= 1

    def scratch(self, device: torch.device) -> torch.Tensor:
        """The codecs' fp32 scratch on ``device`` (two pieces: [Note: Wire buffers])."""
        s = self._scratch.get(device)
        if s is None:
            s = self._scratch[device] = torch.empty(2 * PIECE, device=device)
        return s

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device)
            g.manual_seed(self._seed * 1_000_003 + self.rank)
        return g

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter(
        self,
        inp: torch.Tensor,
        out: torch.Tensor,
        codec: Codec = Exact(),
        add: bool = False,
        bucket: int | None = None,
    ) -> _Pending:
        """Async SUM reduce-scatter of ``inp`` (a staged bucket, ``world * out.numel()``) into
        ``out`` (this rank's grad shard), through ``codec``; with ``add`` the sum is added to
        ``out`` (it holds an unconsumed gradient). ``inp`` is the caller's until the returned
        work is waited for (:meth:`wait`)."""
        if isinstance(codec, BlockFormat):
            return self._reduce_scatter_blocks(inp, out, codec, add, bucket)
        shard = inp.numel() // self.world
        own = inp[self.rank * shard : (self.rank + 1) * shard]
        direct = out.dtype == inp.dtype and not add
        target = out if direct else own  # else in place, cast or added when done
        fold = None if direct else functools.partial(_fold, out, own, add)
        self._count("reduce_scatter", inp.nbytes, bucket)
        if self._point_to_point(inp.device):  # See [Note: Gloo reduce-scatter point to point]
            # the first peer's contribution lands in the grad shard itself when it is free
            # (``direct``); the others in a receive buffer of the pool
            key: _Key = ("receive", inp.dtype, inp.device)
            peers = [r for r in range(self.world) if r != self.rank]
            in_shard = direct and bool(peers)  # the first peer's chunk lands in the shard
            buffered = len(peers) - int(in_shard)  # the chunks the buffer takes
            n = buffered * shard
            if not direct and n > self._size.get(key, 0):
                # the first reduction into a shard that is not free: the full-size buffers,
                # as many as a kept pool holds, once
                full, count = self._receive_full.get(key, (n, 0))
                self._reserve(key, max(full, n), count)
            base = self.take(key, n) if buffered else None
            into = [target] if in_shard else []
            if base is not None:
                into += [base[k * shard : (k + 1) * shard] for k in range(buffered)]
            finish = functools.partial(self._add_received, target, own, base, shard, in_shard, fold)
            if not peers:
                return _Pending("reduce_scatter", [], finish)
            ops: list[dist.P2POp] = []
            for r, mine in zip(peers, into, strict=True):
                peer, theirs = self.global_ranks[r], inp[r * shard : (r + 1) * shard]
                ops.append(dist.P2POp(dist.isend, theirs, peer, self.group))
                ops.append(dist.P2POp(dist.irecv, mine, peer, self.group))
            works = dist.batch_isend_irecv(ops)
            return _Pending("reduce_scatter", list(works), finish)
        if self.gloo:  # CUDA tensors: [Note: Gloo reduce-scatter point to point]
            chunks = list(inp.chunk(self.world))
            work = dist.reduce_scatter(
                target, chunks, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
        else:
            work = reduce_scatter_single(
                target, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
        return _Pending("reduce_scatter", _works(work), fold)

    def _point_to_point(self, device: torch.device) -> bool:
        """Whether reduce-scatters of tensors on ``device`` run point to point: Gloo, CPU
        ([Note: Gloo reduce-scatter point to point])."""
        return self.gloo and device.type == "cpu"

    def _add_received(
        self,
        out: torch.Tensor,
        own: torch.Tensor,
        base: torch.Tensor | None,
        shard: int,
        in_shard: bool,
        fold: Callable[[], None] | None,
    ) -> None:
        if in_shard:
            out.add_(own)  # out held the first peer's contribution: own + it, commuted
        elif out.data_ptr() != own.data_ptr():  # (over one rank: the sum is own)
            out.copy_(own)
        if base is not None:
            for j in range(self.world - 1 - int(in_shard)):
                out.add_(base[j * shard : (j + 1) * shard])
            self.give(("receive", base.dtype, base.device), base)
        if fold is not None:
            fold()

    def _reduce_scatter_blocks(
        self, inp: torch.Tensor, out: torch.Tensor, fmt: BlockFormat, add: bool,
        bucket: int | None,
    ) -> _Pending:  # fmt: skip
        """See [Note: Quantized reduce-scatter]."""
        world, shard = self.world, inp.numel() // self.world
        step = fmt.nbytes(shard)
        key: _Key = ("encoded", torch.uint8, inp.device)
        send, recv = self.take(key, world * step), self.take(key, world * step)
        scratch = self.scratch(inp.device)
        gen = self._generator(inp.device) if fmt.stochastic else None
        for r in range(world):
            if r != self.rank:
                chunk = send[r * step : (r + 1) * step]
                encode(fmt, inp[r * shard : (r + 1) * shard], chunk, scratch, gen)
        self._count("reduce_scatter", world * step, bucket, world * fmt.scale_bytes(shard))
        own = inp[self.rank * shard : (self.rank + 1) * shard]
        finish = functools.partial(self._sum_decoded, fmt, out, own, recv, step, add, send)
        if world == 1:
            return _Pending("reduce_scatter", [], finish)
        work = dist.all_to_all_single(
            recv[: world * step], send[: world * step], group=self.group, async_op=True
        )
        return _Pending("reduce_scatter", _works(work), finish)

    def _sum_decoded(
        self, fmt: BlockFormat, out: torch.Tensor, own: torch.Tensor, recv: torch.Tensor,
        step: int, add: bool, send: torch.Tensor,
    ) -> None:  # fmt: skip
        """The owner's fp32 sum in rank order ([Note: Quantized reduce-scatter])."""
        key: _Key = ("encoded", torch.uint8, recv.device)
        self.give(key, send)
        direct = out.dtype == torch.float32 and not add
        sum_base = None if direct else self.take(("sum", torch.float32, out.device), out.numel())
        acc = out if sum_base is None else sum_base[: out.numel()]
        scratch = self.scratch(out.device)
        with torch.no_grad():
            for r in range(self.world):
                if r == self.rank:
                    if r == 0:
                        acc.copy_(own)
                    else:
                        acc.add_(own)
                    continue
                chunk = recv[r * step : (r + 1) * step]
                if r == 0:
                    decode(fmt, chunk, acc, scratch)
                else:
                    decode_add(fmt, chunk, acc, scratch)
            if add:
                out.add_(acc)
            elif not direct:
                out.copy_(acc)
        self.give(key, recv)
        if sum_base is not None:
            self.give(("sum", torch.float32, out.device), sum_base)

    # ------------------------------------------------------------------ all-gather
    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, bucket: int | None = None
    ) -> _Pending:
        """Async all-gather of every rank's ``inp`` into ``out`` (``inp`` may be this rank's
        range of ``out``: in place, as the param gathers run)."""
        self._count("all_gather", out.nbytes, bucket)
        return self._gather_chunks(out, inp)

    def _gather_chunks(
        self, out: torch.Tensor, inp: torch.Tensor, finish: Callable[[], None] | None = None
    ) -> _Pending:
        if self.gloo:  # See [Note: Gloo all-gather by broadcasts]
            chunks = out.chunk(self.world)
            mine = chunks[self.rank]
            if not (mine.data_ptr() == inp.data_ptr() and mine.shape == inp.shape):
                mine.copy_(inp)
            works = [
                dist.broadcast(c, src=self.global_ranks[r], group=self.group, async_op=True)
                for r, c in enumerate(chunks)
            ]
            return _Pending("all_gather", [w for w in works if w is not None], finish)
        work = all_gather_single(out, inp, group=self.group, async_op=True)
        return _Pending("all_gather", _works(work), finish)

    def all_gather_deltas(
        self,
        flat: torch.Tensor,
        fmt: BlockFormat,
        delta: Callable[[torch.Tensor], None],
        bucket: int | None = None,
    ) -> _Pending:
        """Async weight-delta all-gather of the replica ``flat`` ([Note: Weight deltas]):
        ``delta(out)`` writes ``exact - replica`` of this rank's chunk into the fp32 ``out``."""
        world, shard = self.world, flat.numel() // self.world
        step = fmt.nbytes(shard)
        device = flat.device
        while len(self._deltas) >= MAX_DELTA_GATHERS:  # [Note: Wire buffers]
            self.wait(self._deltas.popleft())
        key: _Key = ("encoded", torch.uint8, device)
        recv = self.take(key, world * step)
        delta_key: _Key = ("delta", torch.float32, device)
        lent = self._idle_staging(device, 4 * shard)  # idle after the step: [Note: Wire buffers]
        delta_base = self.take(delta_key, shard) if lent is None else lent
        diff = delta_base[:shard]
        scratch = self.scratch(device)
        with torch.no_grad():
            delta(diff)
            gen = self._generator(device) if fmt.stochastic else None
            encode(fmt, diff, recv[self.rank * step : (self.rank + 1) * step], scratch, gen)
        if lent is None:
            self.give(delta_key, delta_base)
        self._count("all_gather", world * step, bucket, world * fmt.scale_bytes(shard))
        pending = self._gather_chunks(
            recv[: world * step], recv[self.rank * step : (self.rank + 1) * step]
        )
        pending.finish = functools.partial(self._add_deltas, fmt, flat, recv, step, pending)
        self._deltas.append(pending)
        return pending

    def _add_deltas(
        self, fmt: BlockFormat, flat: torch.Tensor, recv: torch.Tensor, step: int,
        pending: _Pending,
    ) -> None:  # fmt: skip
        # The decode reads and writes the flat buffer, which is still pending for the
        # param-access guard until its owner's transition ([Note: Param access guard] in
        # shardkit.optim._gather): no mode sees the wire's own reads and writes.
        with no_function_modes(), torch.no_grad():
            shard = flat.numel() // self.world
            scratch = self.scratch(flat.device)
            for r in range(self.world):
                decode_add(fmt, recv[r * step : (r + 1) * step],
                           flat[r * shard : (r + 1) * shard], scratch)  # fmt: skip
        self.give(("encoded", torch.uint8, recv.device), recv)
        if pending in self._deltas:
            self._deltas.remove(pending)

    # ------------------------------------------------------------------ small collectives
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
        self._count("all_reduce", t.nbytes, None)
        dist.all_reduce(t, op=op, group=self.group)

    def broadcast(self, t: torch.Tensor, src_group_rank: int) -> None:
        """Blocking broadcast from group rank ``src_group_rank`` (buffers, startup sync)."""
        self._count("broadcast", t.nbytes, None)
        dist.broadcast(t, src=self.global_ranks[src_group_rank], group=self.group)

    def abandon(self, pending: _Pending) -> None:
        """Waits for ``pending``'s works and drops its completion (what it received is not
        summed or decoded): its owner was collected."""
        for work in pending.works:
            work.wait()
        pending.finish = None
        if pending in self._deltas:
            self._deltas.remove(pending)

    def wait(self, pending: _Pending | None) -> None:
        """Waits for ``pending``, completes it (its local sum or decode) and records its
        issue-to-completion time; nothing if it was completed already."""
        if pending is None:
            return
        for work in pending.works:
            work.wait()
        if pending.finish is not None:
            finish, pending.finish = pending.finish, None
            finish()
        if not pending.waited:
            pending.waited = True
            self.stats.seconds[pending.kind] += time.perf_counter() - pending.start


def _fold(out: torch.Tensor, own: torch.Tensor, add: bool) -> None:
    """The reduced chunk ``own`` (staging, wire dtype) into the grad shard ``out``: added when
    it holds an unconsumed gradient, else copied (cast)."""
    if add:
        out.add_(own)
    else:
        out.copy_(own)


def _works(work: object) -> list[dist.Work]:
    """The work of an ``async_op=True`` c10d call, as a list (empty if it returned none)."""
    return [] if work is None else [cast("dist.Work", work)]
