"""Backward side of ``ShardedDataParallel``: stage grads, reduce-scatter buckets in order.

[Note: Staging and launch order]
A param's post-accumulate-grad hook copies its gradient, times ``1/N`` (exactly DDP's
``copy_grad_to_bucket``: ``mul(grad, 1/N)`` into the bucket), into its bucket's *staging*
buffer and drops ``.grad``. A bucket takes a staging buffer when its first gradient arrives and
gives it back when its reduce-scatter has completed; at most two staging buffers of the largest
bucket's size exist per (dtype, device), so no full-size gradient is ever allocated (a third is
allocated, and logged once, only if a backward fills three buckets at once out of plan order).

Buckets are launched strictly in index order on every rank: a complete bucket launches only
once every earlier bucket has launched, so every rank issues the same collectives in the same
order whatever order its hooks fire in. At the end of the backward pass (an autograd-engine
callback, see ``_torch_compat``) the buckets still waiting are flushed: params that got no
gradient in this pass stage what they have (a gradient accumulated under ``no_sync()``) or
zeros, as DDP with ``find_unused_parameters=True`` does, and every remaining bucket launches.

The reduce-scatter writes this rank's range into the bucket's ``grad_shard``; if the shard
already holds a gradient not yet consumed by a step (two synchronised backwards without
``zero_grad``), it writes into a temporary that is added when the work completes, so gradients
accumulate as with DDP.

[Note: Reduce dtype]
With a ``reduce_dtype`` (fairscale's ``reduce_fp16=True`` is ``torch.float16``) the staging
buffers and the reduce-scatter use that dtype for every bucket of another dtype: the hook
writes ``grad * (1/N)`` cast to it (scaling first, so an fp32 gradient up to ``N`` times the
fp16 maximum still fits), the collective moves ``reduce_dtype`` bytes, and the summed shard is
cast into the bucket's ``grad_shard`` (the params' dtype) when the work completes (copied, or
added when the shard already holds an unconsumed gradient). So fp16 reduction of an fp32 model
halves the wire bytes and the staging memory, and costs the precision of an fp16 sum, like
DDP's ``fp16_compress_hook``; ``reduce_dtype=torch.float32`` on a bf16 model sums in fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from shardkit.ddp._comm import _Comm, _Pending
from shardkit.ddp._layout import _Bucket
from shardkit.ddp._ranges import phase
from shardkit.ddp._torch_compat import queue_end_of_backward

__all__: list[str] = []

logger = logging.getLogger("shardkit.ddp")
_MAX_STAGING = 2
_warned_extra_staging = False


class _Reducer:
    """Stages gradients and issues the reduce-scatters of a list of buckets."""

    def __init__(
        self, buckets: Sequence[_Bucket], comm: _Comm, reduce_dtype: torch.dtype | None = None
    ) -> None:
        self.buckets = list(buckets)
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        """See [Note: Reduce dtype]; ``None`` reduces every bucket in its own dtype."""
        self.where: dict[int, tuple[_Bucket, int]] = {
            id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)
        }
        self.scale = 1.0 / comm.world
        self.next_launch = 0
        self.in_backward = False
        self.enabled = True
        """False under ``no_sync()``: hooks leave ``.grad`` to accumulate locally."""
        self.inflight: list[tuple[_Bucket, _Pending]] = []
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._count: dict[tuple[torch.dtype, torch.device], int] = {}
        self._size: dict[tuple[torch.dtype, torch.device], int] = {}
        for b in self.buckets:
            key = self._key(b)
            self._size[key] = max(self._size.get(key, 0), b.numel)
            self._free.setdefault(key, [])
            self._count.setdefault(key, 0)
        self._gaps = {id(b): _gaps(b) for b in self.buckets}

    # ------------------------------------------------------------------ staging buffers
    def wire_dtype(self, b: _Bucket) -> torch.dtype:
        """The dtype ``b`` is staged and reduced in. See [Note: Reduce dtype]."""
        return b.dtype if self.reduce_dtype is None else self.reduce_dtype

    def _key(self, b: _Bucket) -> tuple[torch.dtype, torch.device]:
        return (self.wire_dtype(b), b.device)

    def staging_bytes(self) -> int:
        """Bytes of staging buffers allocated so far."""
        return sum(
            n * self._size[k] * torch.empty((), dtype=k[0]).element_size()
            for k, n in self._count.items()
        )

    def _acquire(self, b: _Bucket) -> torch.Tensor:
        global _warned_extra_staging
        key = self._key(b)
        while not self._free[key] and self._count[key] >= _MAX_STAGING:
            holder = next(
                (i for i, (ob, _) in enumerate(self.inflight) if self._key(ob) == key),
                None,
            )
            if holder is None:
                if not _warned_extra_staging:
                    _warned_extra_staging = True
                    logger.warning(
                        "ShardedDataParallel: more than %d buckets of %s receive gradients at "
                        "once (backward does not follow the bucket order, or an earlier bucket "
                        "waits for params unused in this pass); allocating another staging "
                        "buffer of %d elements",
                        _MAX_STAGING,
                        key[0],
                        self._size[key],
                    )
                break
            self._finish(holder)
        if self._free[key]:
            buf = self._free[key].pop()
        else:
            buf = torch.empty(self._size[key], dtype=key[0], device=b.device)
            self._count[key] += 1
        view = buf[: b.numel]
        for start, end in self._gaps[id(b)]:
            view[start:end].zero_()
        return view

    def _release(self, b: _Bucket) -> None:
        if b.staging is not None:
            base = b.staging._base if b.staging._base is not None else b.staging
            self._free[self._key(b)].append(base)
            b.staging = None

    # ------------------------------------------------------------------ backward
    def on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook body: stage ``p.grad``, drop it, launch what is ready."""
        if not self.enabled:
            return
        if not self.in_backward:
            self.in_backward = True
            self.next_launch = 0
            for b in self.buckets:
                b.reset_backward()
            queue_end_of_backward(self.flush)
        b, i = self.where[id(p)]
        if i not in b.pending or p.grad is None:
            return
        self._stage(b, i, p.grad)
        p.grad = None
        b.pending.discard(i)
        self._launch_ready()

    def _stage(self, b: _Bucket, i: int, grad: torch.Tensor | None) -> None:
        if b.staging is None:
            b.staging = self._acquire(b)
        p = b.params[i]
        view = b.staging[b.offsets[i] : b.offsets[i] + p.numel()].view_as(p)
        if grad is None:
            view.zero_()
        elif view.element_size() <= grad.element_size():  # scale, then cast (or not) to wire
            torch.mul(grad.detach(), self.scale, out=view)
        else:  # a wider reduce dtype: upcast first, scale in it ([Note: Reduce dtype])
            view.copy_(grad.detach()).mul_(self.scale)

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and not self.buckets[self.next_launch].pending:
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        assert b.staging is not None  # every param staged (possibly zeros) before launch
        if b.grad_shard is None:
            b.grad_shard = torch.zeros(b.shard, dtype=b.dtype, device=b.device)
        wire = self.wire_dtype(b)
        if wire == b.dtype and b.grad_fresh:
            out = b.grad_shard
        else:  # a temporary, copied or added into the shard when done ([Note: Reduce dtype])
            out = torch.empty(b.shard, dtype=wire, device=b.device)
        b.out = out
        b.add_out = not b.grad_fresh
        b.grad_fresh = False
        b.launched = True
        with phase("reduce_scatter", b.index):  # See [Note: Profiler ranges]
            self.inflight.append((b, self.comm.reduce_scatter(out, b.staging)))

    def flush(self) -> None:
        """End of backward: stage what unused params have, launch every remaining bucket."""
        try:
            for b in self.buckets[self.next_launch :]:
                for i in sorted(b.pending):
                    p = b.params[i]
                    self._stage(b, i, p.grad)
                    p.grad = None
                b.pending.clear()
            self._launch_ready()
        finally:
            self.in_backward = False

    def _finish(self, index: int) -> None:
        b, pending = self.inflight.pop(index)
        self.comm.wait(pending)
        if b.out is not None and b.grad_shard is not None and b.out is not b.grad_shard:
            if b.add_out:
                b.grad_shard.add_(b.out)
            else:
                b.grad_shard.copy_(b.out)
        b.out = None
        self._release(b)

    def finish_all(self) -> None:
        """Waits for every in-flight reduce-scatter (before a step, clip or state access)."""
        if not self.inflight:
            return
        with phase("wait"):  # See [Note: Profiler ranges]
            while self.inflight:
                self._finish(0)

    def consume(self, buckets: Sequence[_Bucket]) -> None:
        """Marks the grad shards of ``buckets`` consumed (after a step or ``zero_grad``)."""
        for b in buckets:
            b.grad_fresh = True  # the next reduce-scatter overwrites the shard


def _gaps(b: _Bucket) -> list[tuple[int, int]]:
    """Element ranges of the bucket covered by no param (padding), to zero in staging."""
    spans = sorted((off, off + p.numel()) for off, p in zip(b.offsets, b.params, strict=True))
    out: list[tuple[int, int]] = []
    pos = 0
    for start, end in spans:
        if start > pos:
            out.append((pos, start))
        pos = max(pos, end)
    if pos < b.numel:
        out.append((pos, b.numel))
    return out
