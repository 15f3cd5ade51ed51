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

[Note: Reduced-grad placeholders]
Once a synchronised backward has staged a param's gradient, ``.grad`` is not left ``None``
(torch's ``clip_grad_norm_`` would then see no gradient and return 0.0 without clipping): it is
set to that param's :class:`_ReducedGrad`, a ``torch.Tensor`` subclass of the param's shape,
dtype and device that expands one shared 0-d zero per (dtype, device), so it holds no memory.
Its ``__torch_function__`` lets metadata through (``shape``, ``dtype``, ``device``,
``is_sparse``, ``size()``, ...) and turns what ``zero_grad(set_to_none=False)`` of
``nn.Module`` and ``torch.optim`` calls on a ``.grad`` (``zero_``, ``requires_grad_``,
``detach_``, ``_foreach_zero_``) into no-ops; every other torch op (``torch.linalg.vector_norm``,
``torch._foreach_norm``, ``mul_``, ...) raises a RuntimeError naming
``ShardedDataParallel.clip_grad_norm_``. The reduced gradient itself lives in the owners' grad
shards, cut at element boundaries that need not follow any dimension of the param (a rank may
hold 7 rows and 15 elements of a 12 x 16 weight), so it has no DTensor form (``Shard(dim)`` /
``Replicate`` placements per param, FSDP2's answer) that torch's clip could reduce; hence an
error, not a value.

A placeholder never reaches autograd: every bucketed param carries a tensor hook (run before
``AccumulateGrad`` reads ``.grad``) that drops it, so the next backward, ``no_sync()`` or not,
accumulates into ``None`` exactly as after ``zero_grad()``; the reduced gradient is still in the
shard. Placeholders stay after ``step()`` (torch's clip after the step raises too, where DDP
would measure the stale gradients) and are dropped by the wrapper's and the optimizer's
``zero_grad`` (both ``set_to_none`` values: the shards are consumed, so there is no gradient).
``copy.deepcopy`` of a param does not copy ``.grad`` (``nn.Parameter.__deepcopy__``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from shardkit.ddp._comm import _Comm, _Pending
from shardkit.ddp._layout import _Bucket
from shardkit.ddp._profiling import phase
from shardkit.optim import queue_end_of_backward

__all__: list[str] = []

logger = logging.getLogger("shardkit.ddp")
_MAX_STAGING = 2
_ALIGN = 16
"""Staging buffers are a multiple of 16 elements, so each one of a pool starts 64-byte aligned
and can be viewed in a wider dtype (the step's scratch)."""
_warned_extra_staging = False
_logged_views_dtype = False


class _ReducedGrad(torch.Tensor):
    """``.grad`` of a param whose gradient was reduce-scattered into the owners' shards.

    See [Note: Reduced-grad placeholders]. Metadata reads work, torch ops raise.
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" or name in _METADATA:  # property getters and metadata methods
            return cast(Any, super()).__torch_function__(func, types, args, kwargs)
        if name in _NO_OPS:  # what zero_grad(set_to_none=False) calls on a .grad
            return args[0] if args else None
        if name == "_foreach_zero_":  # torch.optim's zero_grad(set_to_none=False), foreach
            for t in args[0]:
                if not isinstance(t, _ReducedGrad):
                    t.zero_()
            return None
        raise RuntimeError(_reduced_grad_error(func, args))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"_ReducedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: "
            f"reduce-scattered by ShardedDataParallel into the owners' gradient shards)"
        )

    def __format__(self, spec: str) -> str:
        return repr(self)


_METADATA = frozenset(
    (
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "storage_offset",
        "element_size",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "untyped_storage",
        "data_ptr",
        "__hash__",
        "__len__",
    )
)
_NO_OPS = frozenset(("zero_", "requires_grad_", "detach_"))


def _reduced_grad_error(func: Callable[..., Any], args: Sequence[Any]) -> str:
    where = [a for a in args if isinstance(a, _ReducedGrad)]
    where += [
        t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, _ReducedGrad)
    ]
    what = f"shape {tuple(where[0].shape)}, {where[0].dtype}" if where else "a param's"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return (
        f"{name} was called on the .grad of a param ({what}) wrapped by "
        f"shardkit.ddp.ShardedDataParallel, whose gradient was reduce-scattered into the "
        f"gradient shards of the ranks that own it: .grad is a placeholder without values, so "
        f"torch.nn.utils.clip_grad_norm_ and any other op on it cannot run. Clip with "
        f"ShardedDataParallel.clip_grad_norm_(max_norm) (or optimizer.clip_grad_norm(max_norm), "
        f"collective, on every rank) after backward and before optimizer.step(). For full "
        f"local gradients in .grad, run the backward under ddp.no_sync() (ddp.reduce() then "
        f"reduces them); for all-reduced full gradients, use torch DistributedDataParallel."
    )


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


def is_placeholder(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a reduced-grad placeholder (see [Note: Reduced-grad placeholders])."""
    return type(t) is _ReducedGrad


class _Reducer:
    """Stages gradients and issues the reduce-scatters of a list of buckets."""

    def __init__(
        self,
        buckets: Sequence[_Bucket],
        comm: _Comm,
        reduce_dtype: torch.dtype | None = None,
        keep_pool: bool = True,
        scratch_bytes: int = 0,
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
        self.keep_pool = keep_pool
        """Keep the staging buffers between backwards (see [Note: Staging lifetime])."""
        self.bucket_views = False
        """Let backward accumulate gradients straight into the staging buffers (see [Note:
        Gradients as bucket views])."""
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """``id(param)`` -> (param, the staging view set as its ``.grad`` in this backward)."""
        self.on_backward_start: Callable[[], None] | None = None
        """Called at the first gradient of a synchronised backward, before any collective of it
        (``ShardedDataParallel``'s agreement; see shardkit-optim's [Note: Call agreement])."""
        """False under ``no_sync()``: hooks leave ``.grad`` to accumulate locally."""
        self.inflight: list[tuple[_Bucket, _Pending]] = []
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._count: dict[tuple[torch.dtype, torch.device], int] = {}
        self._size: dict[tuple[torch.dtype, torch.device], int] = {}
        for b in self.buckets:
            key = self._key(b)
            # See [Note: Staging lifetime]: a buffer also holds the step's scratch
            itemsize = torch.empty((), dtype=key[0]).element_size()
            need = max(b.numel, -(-scratch_bytes // itemsize))
            self._size[key] = max(self._size.get(key, 0), -(-need // _ALIGN) * _ALIGN)
            self._free.setdefault(key, [])
            self._count.setdefault(key, 0)
        if keep_pool:  # allocated once, here: see [Note: Staging lifetime]
            for (dtype, device), size in self._size.items():
                block = torch.empty(_MAX_STAGING * size, dtype=dtype, device=device)
                self._free[(dtype, device)] = [
                    block[k * size : (k + 1) * size] for k in range(_MAX_STAGING)
                ]
                self._count[(dtype, device)] = _MAX_STAGING
        _allocate_grad_shards(self.buckets)
        self._gaps = {id(b): _gaps(b) for b in self.buckets}
        self._bases: dict[int, torch.Tensor] = {}
        """The whole staging buffer of each bucket holding one (its staging is a prefix view)."""
        self.clipped: set[int] = set()
        """Indices of buckets whose reduced gradient was clipped since it was last reduced
        into (a second clip raises, see ``ShardedDataParallel._clip_units``)."""
        zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._placeholders: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            zero = zeros.setdefault(
                (b.dtype, b.device), torch.zeros((), dtype=b.dtype, device=b.device)
            )
            for p in b.params:
                self._placeholders[id(p)] = zero.expand(p.shape).as_subclass(_ReducedGrad)

    # ------------------------------------------------------------------ placeholders
    def register_hooks(self) -> list[Any]:
        """Registers the backward hooks of every bucketed param; returns their handles."""
        handles: list[Any] = []
        for b in self.buckets:
            for p in b.params:
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
        if not (self.bucket_views and self.enabled and self.in_backward) or p.grad is not None:
            return
        b, i = self.where[id(p)]
        if i not in b.pending:
            return
        if self.wire_dtype(b) != b.dtype:
            global _logged_views_dtype
            if not _logged_views_dtype:
                _logged_views_dtype = True
                logger.info(
                    "ShardedDataParallel(gradient_as_bucket_view=True): buckets of %s are "
                    "reduced in %s, so their gradients are copied (cast) into the staging "
                    "buffer instead (logged once)",
                    b.dtype,
                    self.wire_dtype(b),
                )
            return
        if b.staging is None:
            b.staging = self._acquire(b)
        view = b.staging[b.offsets[i] : b.offsets[i] + p.numel()].view_as(p)
        view.zero_()
        self._views[id(p)] = (p, view)
        p.grad = view

    # ------------------------------------------------------------------ clip state
    def clip_flags(self, buckets: Sequence[_Bucket]) -> tuple[bool, bool]:
        """(``buckets`` hold a reduced gradient not consumed yet, one of those was clipped
        already) on this rank. See [Note: Clip agreement]."""
        live = [b for b in buckets if not b.grad_fresh and b.grad_shard is not None]
        return bool(live), any(b.index in self.clipped for b in live)

    def mark_clipped(self, buckets: Sequence[_Bucket]) -> None:
        """Records that the live gradients of ``buckets`` were clipped."""
        self.clipped.update(b.index for b in buckets if not b.grad_fresh)

    # ------------------------------------------------------------------ staging buffers
    def wire_dtype(self, b: _Bucket) -> torch.dtype:
        """The dtype ``b`` is staged and reduced in. See [Note: Reduce dtype]."""
        return b.dtype if self.reduce_dtype is None else self.reduce_dtype

    def _key(self, b: _Bucket) -> tuple[torch.dtype, torch.device]:
        return (self.wire_dtype(b), b.device)

    def staging_bytes(self) -> int:
        """Bytes of staging buffers alive now (see [Note: Staging lifetime])."""
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
        self._bases[id(b)] = buf
        for start, end in self._gaps[id(b)]:
            view[start:end].zero_()
        return view

    def _release(self, b: _Bucket) -> None:
        if b.staging is not None:
            base = self._bases.pop(id(b))
            self._free[self._key(b)].append(base)
            b.staging = None

    # ------------------------------------------------------------------ backward
    def on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook body: stage ``p.grad``, drop it, launch what is ready."""
        if not self.enabled:
            return
        if not self.in_backward:
            if self.on_backward_start is not None:  # the wrapper's agreement: may raise
                self.on_backward_start()
            self.start_pass()
            queue_end_of_backward(self.flush)
        b, i = self.where[id(p)]
        if i not in b.pending or p.grad is None:
            return
        self._stage(b, i, p.grad)
        self._set_placeholder(p)  # See [Note: Reduced-grad placeholders]
        b.pending.discard(i)
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
        self.in_backward = True
        self.next_launch = 0
        for b in self.buckets:
            b.reset_backward()

    def _stage(self, b: _Bucket, i: int, grad: torch.Tensor | None) -> None:
        p = b.params[i]
        _, view = self._views.pop(id(p), (None, None))
        if view is not None and grad is view:  # accumulated in place: scale only
            b.used.add(i)  # See [Note: Per-param fragments] in shardkit.optim._shard_stepper
            view.mul_(self.scale)
            return
        if b.staging is None:
            b.staging = self._acquire(b)
        view = b.staging[b.offsets[i] : b.offsets[i] + p.numel()].view_as(p)
        if grad is None or type(grad) is _ReducedGrad:  # no new gradient in this pass
            view.zero_()
            return
        b.used.add(i)  # See [Note: Per-param fragments] in shardkit.optim._shard_stepper
        g = grad.detach()
        if view.dtype == g.dtype:
            torch.mul(g, self.scale, out=view)
        elif view.element_size() <= g.element_size():  # scale, then cast ([Note: Reduce dtype])
            view.copy_(g.mul_(self.scale))  # in place: no temporary; .grad is dropped next
        else:  # a wider reduce dtype: upcast first, scale in it ([Note: Reduce dtype])
            view.copy_(g).mul_(self.scale)

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and not self.buckets[self.next_launch].pending:
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        assert b.staging is not None  # every param staged (possibly zeros) before launch
        assert b.grad_shard is not None  # allocated with the reducer
        wire = self.wire_dtype(b)
        if wire == b.dtype and b.grad_fresh:
            out = b.grad_shard
        else:  # in place, cast or added into the shard when done ([Note: Staging and launch
            # order], [Note: Reduce dtype])
            out = b.staging[self.comm.rank * b.shard : (self.comm.rank + 1) * b.shard]
        b.out = out
        b.add_out = not b.grad_fresh
        b.grad_fresh = False
        self.clipped.discard(b.index)
        b.launched = True
        with phase("reduce_scatter", b.index):  # See [Note: Profiler ranges]
            self.inflight.append((b, self.comm.reduce_scatter(out, b.staging)))

    def flush(self) -> None:
        """End of backward: stage what unused params have, launch every remaining bucket."""
        try:
            for b in self.buckets[self.next_launch :]:
                for i in sorted(b.pending):
                    p = b.params[i]
                    grad = p.grad
                    if self._views.pop(id(p), (None, None))[1] is grad:  # no gradient came
                        grad = None
                    self._stage(b, i, grad)
                    self._set_placeholder(p)
                b.pending.clear()
            self._launch_ready()
        finally:
            self.in_backward = False
            self._views.clear()

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
        self.wait_inflight()
        self.trim_pool()

    def trim_pool(self) -> None:
        """Frees the idle staging buffers unless the pool is kept ([Note: Staging lifetime])."""
        if not self.in_backward and not self.keep_pool:
            self._empty_pool()

    def idle_buffers(self) -> list[torch.Tensor]:
        """The staging buffers no bucket holds now: the step's scratch ([Note: Staging
        lifetime]). Valid until the next backward stages into them."""
        return [buf for free in self._free.values() for buf in free]

    def wait_inflight(self) -> None:
        """Waits for the in-flight reduce-scatters, in launch order (keeps the pool)."""
        if not self.inflight:
            return
        with phase("wait"):  # See [Note: Profiler ranges]
            while self.inflight:
                self._finish(0)

    # [Note: Staging lifetime]
    # A bucket holds a staging buffer from its bucket's first gradient in backward until its
    # reduce-scatter has completed (``_finish`` returns it to the pool, where the next bucket of
    # the same backward takes it). The pool (two buffers per wire dtype and device, each the
    # size of the largest bucket, in one block) is allocated with the bucket layout and kept from
    # one step to the next (``keep_staging_buffers=True``, the default), as are the grad shards
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
        for key, free in self._free.items():
            self._count[key] -= len(free)
            free.clear()

    def consume(self, buckets: Sequence[_Bucket]) -> None:
        """Marks the grad shards of ``buckets`` consumed (after a step or ``zero_grad``)."""
        for b in buckets:
            b.grad_fresh = True  # the next reduce-scatter overwrites the shard
            b.used.clear()
            self.clipped.discard(b.index)


# [Note: Clip agreement]
# ``ShardedDataParallel.clip_grad_norm_`` (and a wrapped ``optimizer.clip_grad_norm``) must not
# return 0.0 when there is nothing to clip. Per bucket, ``grad_fresh`` says whether its shard
# holds a gradient reduced since the last step / zero_grad (set at each reduce-scatter launch,
# cleared by ``consume``), and ``_Reducer.clipped`` whether that gradient was clipped already
# (cleared by the next launch into the bucket and by ``consume``). Both change only at
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


def _allocate_grad_shards(buckets: Sequence[_Bucket]) -> None:
    """Gives every bucket its ``grad_shard``: views of one zeroed buffer per (dtype, device),
    allocated once with the layout (see [Note: Staging lifetime])."""
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for b in buckets:
        if b.grad_shard is None:
            key = (b.dtype, b.device)
            sizes[key] = sizes.get(key, 0) + -(-b.shard // _ALIGN) * _ALIGN
    flats = {key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
    offsets = dict.fromkeys(sizes, 0)
    for b in buckets:
        if b.grad_shard is None:
            key = (b.dtype, b.device)
            b.grad_shard = flats[key][offsets[key] : offsets[key] + b.shard]
            offsets[key] += -(-b.shard // _ALIGN) * _ALIGN


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
