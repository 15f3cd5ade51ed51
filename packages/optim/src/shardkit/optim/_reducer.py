"""Backward side of ``ShardedDataParallel``: stage grads, reduce-scatter buckets in order.

[Note: Staging and launch order]
A param's post-accumulate-grad hook copies its gradient, times ``1/N`` (exactly DDP's
``copy_grad_to_bucket``: ``mul(grad, 1/N)`` into the bucket), into its bucket's *staging*
buffer and drops ``.grad``. A bucket takes a staging buffer when its first gradient arrives and
gives it back when its reduce-scatter has completed; at most two staging buffers of the largest
bucket's size exist per (dtype, device), so no full-size gradient is ever allocated (a third is
allocated, and logged once, only if a backward fills three buckets at once out of plan order).

Buckets are launched strictly in index order on every rank, over the buckets of every bucket
group of the wrapper (``_Reducer.order``; each group stages, launches and finishes its own
buckets when the pass asks: [Note: Bucket group state] in ``shardkit.optim._lifecycle``): a
complete bucket launches only
once every earlier bucket has launched, so every rank issues the same collectives in the same
order whatever order its hooks fire in. At the end of the backward pass (an autograd-engine
callback, ``shardkit.optim.queue_end_of_backward``) the buckets still waiting are flushed: params that got no
gradient in this pass stage what they have (a gradient accumulated under ``no_sync()``) or
zeros, as DDP with ``find_unused_parameters=True`` does, and every remaining bucket launches.

The reduce-scatter writes this rank's range into the bucket's ``grad_shard``. If the shard
already holds a gradient not yet consumed by a step (two synchronised backwards without
``zero_grad``), or if the bucket is reduced in another dtype ([Note: Reduce dtype]), it reduces
in place into this rank's own range of the staging buffer instead (NCCL and Gloo's list form
reduce-scatter in place when the output is the rank's chunk of the input), which is added or
cast into the shard when the work completes: gradients accumulate as with DDP, and no
temporary is allocated.

[Note: Gradients as bucket views]
With ``gradient_as_bucket_view=True`` backward writes a param's gradient where the
reduce-scatter reads it, as DDP's option of that name and Megatron's grad buffer do: once a
synchronised backward has begun (its first gradient arrived), the param's tensor hook, which
runs just before ``AccumulateGrad``, takes its bucket's staging buffer (acquiring it from the
pool on the bucket's first param), zeroes the param's slice and sets it as ``.grad``;
``AccumulateGrad`` then adds the autograd gradient into it in place, and the post-accumulate
hook only scales the slice by ``1/N`` in place (the same multiply the copy does, so the bits
are the same). There is no staging copy. What stays is the gradient the autograd kernel
allocates for the param on every backward: no public API lets a kernel write into a given
buffer (Megatron's gradient-accumulation fusion is a custom Linear autograd function and a
CUDA kernel), and ``+=`` into a zeroed slice moves more bytes than the default's one
multiply-copy (a zero, an add and a scale: about three times the memory traffic). The default
is therefore the copy: on the 8 x Linear(2048) step of ``bench_systems.py`` (CPU, one thread
per rank) the views gave 1.16x and 1.13x DDP against the copy's 1.04x and 1.10x in two
runs; on a GPU, where bandwidth is the cost, the ratio of bytes is the same. Staged by copy as before: the backward's first gradient (its pass has
not begun yet), a gradient accumulated under ``no_sync()``, a bucket reduced in another dtype
([Note: Reduce dtype]), and a ``.grad`` that ``AccumulateGrad`` replaced instead of adding
into (``create_graph=True``). A view that no gradient reached by the end of backward counts as
no gradient. The memory is the same pool either way ([Note: Staging lifetime]).

[Note: Reduce dtype]
With a ``reduce_dtype`` (fairscale's ``reduce_fp16=True`` is ``torch.float16``) the staging
buffers and the reduce-scatter use that dtype for every bucket of another dtype: the hook
writes ``grad * (1/N)`` cast to it (scaling first, so an fp32 gradient up to ``N`` times the
fp16 maximum still fits), the collective moves ``reduce_dtype`` bytes, and the summed shard is
cast into the bucket's ``grad_shard`` (the params' dtype) when the work completes (copied, or
added when the shard already holds an unconsumed gradient). The scale is applied in place to
the gradient autograd handed over (it is dropped right after, as in the copy) before the cast
copy, so no temporary of the gradient's size is made (``torch.mul(..., out=)`` into another
dtype computes into one). So fp16 reduction of an fp32 model
halves the wire bytes and the staging memory, and costs the precision of an fp16 sum, like
DDP's ``fp16_compress_hook``; ``reduce_dtype=torch.float32`` on a bf16 model sums in fp32.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

import torch
from shardkit.optim._flat import FlatBucket
from shardkit.optim._lifecycle import PassLife
from shardkit.optim._options import EngineOptions
from shardkit.optim._placeholders import _ReducedGrad, is_placeholder
from shardkit.optim._profiling import NO_RANGE
from shardkit.optim._profiling import zero2_phase as phase
from shardkit.optim._torch_compat import profiling, queue_end_of_backward
from shardkit.optim._wire import Codec, Wire

__all__ = ["ALIGN", "BucketOwner", "ParamMap", "check_clip", "drop_grads", "param_map"]

logger = logging.getLogger("shardkit.optim")
_MAX_STAGING = 2
ALIGN = 16
"""Staging buffers are a multiple of 16 elements, so each one of a pool starts 64-byte aligned
and can be viewed in a wider dtype (the step's scratch)."""
_warned_extra_staging = False
_logged_views_dtype = False


class _WeakHook:
    """The post-accumulate-grad hook of a bucketed param: calls ``_Reducer.on_grad`` through a
    weak reference.

    [Note: Post-accumulate hooks hold weakly]
    torch keeps a param's post-accumulate-grad hooks where the garbage collector cannot see
    them, so a hook that refers (through the reducer, its buckets) back to the param forms a
    cycle that is never collected: every ``ShardedDataParallel`` built in a process, its model
    and its optimizer would stay alive for good (``tests/test_gather.py`` checks that a dropped
    wrapper is freed).
    The hook holds the reducer weakly instead; the wrapper holds it strongly. The tensor hooks
    (``register_hook``) are visible to the collector and hold it directly.
    """

    __slots__ = ("reducer",)

    def __init__(self, reducer: _Reducer) -> None:
        self.reducer = weakref.ref(reducer)

    def __call__(self, p: torch.Tensor) -> None:
        reducer = self.reducer()
        if reducer is not None:
            reducer.on_grad(p)


ParamMap = dict[int, tuple[int, int, int]]
"""``id(param)`` -> (its group's index, its bucket's position in the group, its position in the
bucket): the one param map of a bucket layout, built by :func:`param_map` and shared, read
only, by the backward pass and the groups."""


def param_map(per_group: Sequence[Sequence[FlatBucket]]) -> ParamMap:
    """The :data:`ParamMap` of the buckets of each group (a param is in it iff it was
    trainable when the layout was built)."""
    return {
        id(p): (gi, k, i)
        for gi, buckets in enumerate(per_group)
        for k, b in enumerate(buckets)
        for i, p in enumerate(b.params)
    }


class BucketOwner(Protocol):
    """What the backward pass needs of a bucket group (``shardkit.optim._bucket_group``'s
    ``BucketGroup``, the only writer of its buckets' reduction state)."""

    @property
    def buckets(self) -> Sequence[FlatBucket]: ...

    def scratch_bytes(self) -> int: ...

    def begin_pass(self) -> None: ...

    def is_pending(self, k: int, i: int) -> bool: ...

    def pending(self, k: int) -> list[int]: ...

    def wire_dtype(self, k: int) -> torch.dtype: ...

    def codec(self, k: int) -> Codec: ...

    def has_staging(self, k: int) -> bool: ...

    def take_staging(self, k: int, base: torch.Tensor) -> None: ...

    def grad_view(self, k: int, i: int) -> torch.Tensor: ...

    def stage(self, k: int, i: int, grad: torch.Tensor | None, in_place: bool = False) -> None: ...

    def ready(self, k: int) -> bool: ...

    def launch(self, k: int) -> None: ...

    def finish(self, k: int) -> torch.Tensor: ...


class _Reducer:
    """The wrapper's backward pass over every bucket group: hooks, bucket order, staging pool.

    Built once per wrapper; :meth:`lay_out` takes each (re)built bucket layout. The groups
    own their buckets' reduction state ([Note: Bucket group state] in
    ``shardkit.optim._lifecycle``); this pass decides when each is staged, launched and
    finished: buckets launch strictly in index order over every group ([Note: Staging and
    launch order]), and the staging buffers are lent from one pool per wire dtype and device.

    Args:
        comm: The engine's communication layer.
        config: The engine's options (``wire_dtype``, ``keep_staging_buffers``,
            ``gradient_as_bucket_view``).
        on_backward_start: Called at the first gradient of a synchronised backward, before
            any collective of it (the engine's reduction agreement, ``Zero2Engine``; see
            [Note: Call agreement]).
    """

    def __init__(
        self,
        comm: Wire,
        config: EngineOptions,
        on_backward_start: Callable[[], None],
    ) -> None:
        self.comm = comm
        self.config = config
        self.on_backward_start = on_backward_start
        self.enabled = True
        """False under ``no_sync()``: hooks leave ``.grad`` to accumulate locally."""
        self.passes = PassLife()
        """The pass's state (see [Note: Bucket group state] in ``shardkit.optim._lifecycle``)."""
        self.order: list[tuple[BucketOwner, int]] = []
        """Every bucket as (group, position in the group), in launch (index) order."""
        self.groups: list[BucketOwner] = []
        self.where: ParamMap = {}
        """The layout's param map (see :data:`ParamMap`)."""
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """``id(param)`` -> (param, the staging view set as its ``.grad`` in this backward)."""
        self._size: dict[tuple[str, torch.dtype, torch.device], int] = {}
        """The staging buffers' size per pool key (the wire's pool holds them)."""
        self._placeholders: dict[int, torch.Tensor] = {}
        self._hooks: list[Any] = []

    def lay_out(self, groups: Sequence[BucketOwner], where: ParamMap) -> None:
        """Takes the groups' (re)built buckets and their param map: the staging pool, the
        placeholders and the gradient hooks (the old ones removed). Nothing is in flight."""
        self.groups = list(groups)
        self.order = [(g, k) for g in groups for k in range(len(g.buckets))]
        self.where = where
        self.passes.reset()
        self._size = {}
        scratch_bytes = max((g.scratch_bytes() for g in groups), default=0)
        for g, k in self.order:
            key = self._key(g, k)
            # See [Note: Staging lifetime]: a buffer also holds the step's scratch
            itemsize = torch.empty((), dtype=key[1]).element_size()
            need = max(g.buckets[k].numel, -(-scratch_bytes // itemsize))
            self._size[key] = max(self._size.get(key, 0), -(-need // ALIGN) * ALIGN)
        # One pool, the wire's, for every buffer of the collectives and the step ([Note: Wire
        # buffers] in shardkit.optim._wire), allocated here when kept: [Note: Staging lifetime]
        self.comm.release()
        keep = _MAX_STAGING if self.config.keep_staging_buffers else 0
        for g, k in self.order:
            b = g.buckets[k]
            into_shard = g.wire_dtype(k) == b.dtype  # the grad shard can take a peer's chunk
            self.comm.reserve(g.codec(k), g.wire_dtype(k), b.device, b.numel, keep, into_shard)
        for (_, dtype, device), size in self._size.items():
            self.comm.reserve_staging(dtype, device, size, keep)
        zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._placeholders = {}
        for g, k in self.order:
            b = g.buckets[k]
            zero = zeros.setdefault(
                (b.dtype, b.device), torch.zeros((), dtype=b.dtype, device=b.device)
            )
            for p in b.params:
                self._placeholders[id(p)] = zero.expand(p.shape).as_subclass(_ReducedGrad)
        for h in self._hooks:
            h.remove()
        self._hooks = self._register_hooks()

    def close(self) -> None:
        """Removes the gradient hooks and drops the ``.grad`` placeholders (``close()``; no
        backward is running)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for g, k in self.order:
            for p in g.buckets[k].params:
                if is_placeholder(p.grad):
                    p.grad = None
        self._placeholders = {}

    # ------------------------------------------------------------------ placeholders
    def _register_hooks(self) -> list[Any]:
        """Registers the backward hooks of every bucketed param; returns their handles."""
        handles: list[Any] = []
        for g, k in self.order:
            for p in g.buckets[k].params:
                param = cast(Any, p)
                handles.append(param.register_hook(functools.partial(self.before_grad, p)))
                handles.append(param.register_post_accumulate_grad_hook(_WeakHook(self)))
        return handles

    def _set_placeholder(self, p: torch.Tensor) -> None:
        p.grad = self._placeholders[id(p)]

    def before_grad(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Tensor hook of every bucketed param: runs before ``AccumulateGrad`` reads ``.grad``.

        Drops a placeholder ([Note: Reduced-grad placeholders]); with bucket views, hands the
        param a zeroed view of its bucket's staging buffer to accumulate into ([Note:
        Gradients as bucket views]).
        """
        if type(p.grad) is _ReducedGrad:
            p.grad = None
        views = self.config.gradient_as_bucket_view
        if not (views and self.enabled and self.passes.in_backward) or p.grad is not None:
            return
        gi, k, i = self.where[id(p)]
        g = self.groups[gi]
        if not g.is_pending(k, i):
            return
        b = g.buckets[k]
        if g.wire_dtype(k) != b.dtype:
            global _logged_views_dtype
            if not _logged_views_dtype:
                _logged_views_dtype = True
                logger.info(
                    "ShardedDataParallel(gradient_as_bucket_view=True): buckets of %s are "
                    "reduced in %s, so their gradients are copied (cast) into the staging "
                    "buffer instead (logged once)",
                    b.dtype,
                    g.wire_dtype(k),
                )
            return
        self._ensure_staging(g, k)
        view = g.grad_view(k, i)
        self._views[id(p)] = (p, view)
        p.grad = view

    # ------------------------------------------------------------------ staging buffers
    def _key(self, g: BucketOwner, k: int) -> tuple[str, torch.dtype, torch.device]:
        return ("staging", g.wire_dtype(k), g.buckets[k].device)

    def staging_bytes(self) -> int:
        """Bytes of the pool's buffers alive now: staging, the wire's, the codec scratch (see
        [Note: Staging lifetime])."""
        return self.comm.pool_bytes()

    def _ensure_staging(self, g: BucketOwner, k: int) -> None:
        """Lends bucket ``k`` of ``g`` a staging buffer from the pool if it holds none."""
        if not g.has_staging(k):
            g.take_staging(k, self._acquire(g, k))

    def _acquire(self, g: BucketOwner, k: int) -> torch.Tensor:
        global _warned_extra_staging
        key = self._key(g, k)
        while not self.comm.has_idle(key) and self.comm.live(key) >= _MAX_STAGING:
            holder = next(
                (j for j, (og, ok) in enumerate(self.passes.inflight) if self._key(og, ok) == key),
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
                        key[1],
                        self._size[key],
                    )
                break
            self._finish(holder)
        return self.comm.take(key, self._size[key])

    # ------------------------------------------------------------------ backward
    def on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook body: stage ``p.grad``, drop it, launch what is ready."""
        if not self.enabled:
            return
        if not self.passes.in_backward:
            self.on_backward_start()  # the engine's agreement: may raise
            self.start_pass()
            queue_end_of_backward(self.flush)
        gi, k, i = self.where[id(p)]
        g = self.groups[gi]
        if not g.is_pending(k, i) or p.grad is None:
            return
        self._stage(g, k, i, p.grad)
        self._set_placeholder(p)  # See [Note: Reduced-grad placeholders]
        self._launch_ready()

    def start_pass(self) -> None:
        """Starts a reduction pass (a synchronised backward, or ``reduce()``).

        The previous pass's reduce-scatters are waited for first: a bucket's staging buffer
        and its ``out`` belong to its in-flight reduction until it completes, and a second
        synchronised backward without a step in between (gradients accumulate, as with DDP)
        must neither stage into a buffer still being read nor add into the grad shard before
        the earlier reduction has written it.
        """
        self.wait_inflight()
        for p, view in self._views.values():  # left by a backward that raised before flush
            if p.grad is view:
                p.grad = None
        self._views.clear()
        self.passes.start()
        for g in self.groups:
            g.begin_pass()

    def _stage(self, g: BucketOwner, k: int, i: int, grad: torch.Tensor | None) -> None:
        p = g.buckets[k].params[i]
        _, view = self._views.pop(id(p), (None, None))
        if view is not None and grad is view:  # accumulated in place: scale only
            g.stage(k, i, grad, in_place=True)
            return
        self._ensure_staging(g, k)
        g.stage(k, i, grad)

    def _launch_ready(self) -> None:
        passes, order = self.passes, self.order
        while passes.next_launch < len(order) and order[passes.next_launch][0].ready(
            order[passes.next_launch][1]
        ):
            g, k = order[passes.next_launch]
            g.launch(k)
            passes.launched(g, k)

    def flush(self) -> None:
        """End of backward: stage what unused params have, launch every remaining bucket."""
        try:
            for g, k in self.order[self.passes.next_launch :]:
                for i in g.pending(k):
                    p = g.buckets[k].params[i]
                    grad = p.grad
                    if self._views.pop(id(p), (None, None))[1] is grad:  # no gradient came
                        grad = None
                    self._stage(g, k, i, grad)
                    self._set_placeholder(p)
            self._launch_ready()
        finally:
            self.passes.end()
            self._views.clear()

    def end_aborted_pass(self) -> None:
        """Forgets a pass whose backward raised before its end (nothing of it in flight)."""
        self.passes.forget_aborted()

    def set_enabled(self, enabled: bool) -> None:
        """Hooks reduce (``True``) or leave ``.grad`` to accumulate (``False``, ``no_sync``)."""
        self.enabled = enabled

    def _finish(self, index: int) -> None:
        g, k = self.passes.finished(index)
        base = g.finish(k)
        self.comm.give(self._key(g, k), base)

    def finish_all(self) -> None:
        """Waits for every in-flight reduce-scatter (before a step, clip or state access)."""
        if not self.passes.inflight:
            return
        self.wait_inflight()
        self.trim_pool()

    def trim_pool(self) -> None:
        """Frees the idle staging buffers unless the pool is kept ([Note: Staging lifetime])."""
        if not self.passes.in_backward and not self.config.keep_staging_buffers:
            self._empty_pool()

    def idle_buffers(self) -> list[torch.Tensor]:
        """The staging buffers no bucket holds now: the step's scratch ([Note: Staging
        lifetime]). Valid until the next backward stages into them."""
        return self.comm.idle("staging")

    def wait_inflight(self) -> None:
        """Waits for the in-flight reduce-scatters, in launch order (keeps the pool)."""
        if not self.passes.inflight:
            return
        # See [Note: Profiler ranges]
        with phase("wait") if profiling() else NO_RANGE:
            while self.passes.inflight:
                self._finish(0)

    # [Note: Staging lifetime]
    # A bucket holds a staging buffer from its bucket's first gradient in backward until its
    # reduce-scatter has completed (``_finish`` returns it to the pool, where the next bucket of
    # the same backward takes it). The pool (two buffers per wire dtype and device, each the
    # size of the largest bucket, in one block; on Gloo also the comm layer's two receive
    # buffers of (N-1)/N of it: [Note: Gloo reduce-scatter point to point]) is allocated with the
    # bucket layout and kept from one step to the next (``keep_staging_buffers=True``, the
    # default), as are the grad shards
    # (views of one buffer per dtype and device), so no step allocates a bucket-sized tensor. A
    # buffer freed and allocated again every step costs a caching allocator (CUDA) reserved
    # memory only; on CPU glibc keeps the freed pages resident and, as other sizes come and go
    # in between (autograd's gradients), hands out new ones (the README's memory section has
    # the figures). One block apiece also keeps
    # these long-lived buffers out of the heap that the per-step gradients churn through (glibc
    # maps a block of 32 MiB or more on its own).
    #
    # Between steps the pool is idle, and the local step borrows it as its scratch (the fp32
    # gradients of the masters, bucket by bucket: ``idle_buffers``, shardkit-optim's
    # ``ShardStepper.step(scratch=...)``); each buffer is sized to hold that scratch too (from
    # world 2 on a bucket's staging bytes already cover its shard's fp32 gradients). The cost is
    # two buckets' memory at rest (2 x 25 MiB with the default bucket cap). With
    # ``keep_staging_buffers=False`` the pool is emptied once a step, clip, zero_grad or state
    # access has waited for the last reduction (after the step's scratch use), so between steps
    # a rank holds params, grad shards and optimizer state only; on CUDA the caching allocator
    # then lends those blocks to the next forward's activations, on CPU the pages stay resident
    # and every backward allocates the pool again.
    def _empty_pool(self) -> None:
        self.comm.release()


# [Note: Clip agreement]
# ``ShardedDataParallel.clip_grad_norm_`` (and a wrapped ``optimizer.clip_grad_norm``) must not
# return 0.0 when there is nothing to clip. Per bucket, ``grad_fresh`` says whether its shard
# holds a gradient reduced since the last step / zero_grad (cleared at each reduce-scatter
# launch, set again when a step or ``zero_grad`` consumes the shard), and its
# ``BucketLife.clipped`` (the group's state machine, shardkit.optim._lifecycle) whether that
# gradient was clipped already (cleared by the next launch into the bucket and when the shard
# is consumed). Both change only at
# collective points (launches in bucket order, steps, clips), so well-formed programs agree on
# them; still, each rank's two flags (any live bucket, any live bucket clipped) ride in its row
# of the clip's one all-gather (shardkit-optim's ``agree_grad_norm``, its [Note: Sharded grad
# norm]), and every rank decides from every rank's flags: no extra collective, the same raise
# on every rank, never a hang. No live bucket: raise (after ``step()``, after ``zero_grad()``,
# before any backward); a live bucket clipped already: raise (called twice); ranks that
# disagree: raise, naming how many ranks have each.
def check_clip(flags: Sequence[Sequence[bool]]) -> None:
    """Raises on every rank unless every rank has unclipped reduced gradients.

    ``flags``: every rank's (has live gradients, has clipped ones), in rank order.
    """
    world = len(flags)
    for k, what in enumerate(("gradients to clip", "already clipped gradients")):
        count = sum(bool(f[k]) for f in flags)
        if 0 < count < world:
            raise RuntimeError(
                f"clip_grad_norm_: ranks disagree: {count} of {world} ranks have {what}. Every "
                f"rank must run the same backward passes, step() and clip calls in the same "
                f"order; raised on every rank"
            )
    if not all(f[0] for f in flags):
        raise RuntimeError(
            "ShardedDataParallel.clip_grad_norm_ / optimizer.clip_grad_norm found no gradient to "
            "clip: none was reduced since the last optimizer.step() or zero_grad() (the step "
            "consumes the reduced gradients; a clip after it would clip nothing). Call it after "
            "backward and before step(), on every rank."
        )
    if any(f[1] for f in flags):
        raise RuntimeError(
            "ShardedDataParallel.clip_grad_norm_ / optimizer.clip_grad_norm was already called on "
            "these gradients since they were reduced: clip once, after backward and before "
            "step() (a second clip would only measure the clipped gradients)."
        )


def drop_grads(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    """``zero_grad`` of ``params``' ``.grad`` after their reduced gradients were consumed: a
    placeholder is dropped whatever ``set_to_none`` says (the shard it stood for is consumed;
    see [Note: Reduced-grad placeholders] in ``shardkit.optim._placeholders``), a full local
    gradient is zeroed or dropped."""
    for p in params:
        if p.grad is not None:
            if set_to_none or type(p.grad) is _ReducedGrad:
                p.grad = None
            else:
                p.grad.zero_()
