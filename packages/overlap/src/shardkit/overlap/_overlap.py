"""``ZeroOverlap``: the DDP comm hook that steps a ShardedOptimizer bucket by bucket."""

# No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at
# registration and needs the real classes (see _torch_compat).
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer, StepDriver, queue_end_of_backward
from shardkit.overlap._config import OverlapConfig
from shardkit.overlap._ownership import _apply_partition, _ddp_params, _planned_partition
from shardkit.overlap._profiling import phase
from shardkit.overlap._torch_compat import GradBucket
from shardkit.overlap._validation import (
    _agree_registration,
    _agreement_group,
    _check_groups,
    _check_params,
    _check_reduce_to_owner,
    _check_supported,
    _check_types,
    _registration_signature,
)
from torch.nn.parallel import DistributedDataParallel

__all__ = ["CommHook", "ZeroOverlap"]

logger = logging.getLogger("shardkit.overlap")
_logged_loop_step = False
_logged_deferred = False

CommHook = Callable[[Any, GradBucket], torch.futures.Future[Any]]
"""A DDP communication hook: ``(state, bucket) -> Future`` of the reduced flat gradients."""

_BY_OPTIMIZER: "weakref.WeakKeyDictionary[ShardedOptimizer, ZeroOverlap]" = (
    weakref.WeakKeyDictionary()
)
_BY_DDP: "weakref.WeakKeyDictionary[DistributedDataParallel, ZeroOverlap]" = (
    weakref.WeakKeyDictionary()
)


# [Note: Gloo-safe scheduling]
# torch's ddp_zero_hook refuses Gloo (pytorch#62300). The interleaved hook chains the step and
# the parameter broadcasts to the reduction with ``fut.then(...)``. With NCCL the future is
# marked complete as soon as the work is enqueued, so the callback runs inline on the thread
# that called the hook and every rank issues its collectives in the same order. With Gloo the
# future completes on one of ProcessGroupGloo's worker threads whenever the all-reduce finishes:
# the callback then (1) issues broadcasts from a worker thread at a time that differs between
# ranks, interleaved differently with the all-reduces the autograd thread keeps issuing for later
# buckets. Gloo matches the collectives of a group by their issue order (each gets the next tag
# of the group), so rank 0's broadcast meets rank 1's all-reduce: a hang, or silently mixed
# data. And (2) it blocks that worker thread in ``wait()`` on the broadcasts, which are queued
# behind it on the same small worker pool: a deadlock once every worker waits.
# Here no collective is ever issued, and nothing ever waits, inside a future callback. Every
# collective is issued by the thread that calls the comm hook (the autograd thread), in an order
# fixed by the bucket indices alone: reduce b, then [wait reduce b-2, step b-2, broadcast b-2]
# (interleaved, see [Note: Interleave lag]) or, at the last bucket, [wait reduce k, step k,
# broadcast k] for every k. The only callback is the one of the last bucket's returned future,
# which just returns a value once the last reduction and every broadcast have completed. The same code is correct for NCCL,
# where ``wait()`` only orders the current stream after the reduction.
# The broadcasts of a bucket cover exactly that bucket's params (shardkit-optim's
# ``_sync_params``, see [Note: Exact sync spans] there), one per (bucket, owner) once DDP's
# buckets follow the plan, so they never touch params of a bucket still to be stepped.


# [Note: Step placement]
# Where the sharded step runs, decided at registration and agreed on by every rank:
# * "bucket" (default): in the comm hook, per bucket, as above.
# * "after backward" (``find_unused_parameters=True``): see [Note: Unused parameters].
# * "loop" (an enabled GradScaler, or ``max_grad_norm``): the hooks only reduce and the step
#   runs in the training loop (``ZeroOverlap.step()`` or the usual ``scaler.step(zero)``),
#   exactly as without hooks. A scaler's skip decision needs the inf/nan check of *every*
#   bucket, and global-norm clipping needs the norm of every gradient, before the *first* param
#   changes; a per-bucket step would have applied earlier buckets already. Stepping anyway and
#   undoing on inf would need a copy of the owned params and state plus a second broadcast, for
#   a rare event; the exact, simple placement was chosen. Nothing is overlapped in that mode
#   beyond DDP's usual reduction/backward overlap.


# [Note: Interleave lag]
# The interleaved hook steps and broadcasts bucket ``b - 2`` in the hook call of bucket ``b``,
# not ``b - 1``. A process group runs its async collectives from a FIFO queue on a small pool of
# worker threads. With a lag of 1, the broadcast of bucket ``b - 1`` is queued right before the
# reduction of bucket ``b + 1``, and the next hook call immediately waits for the reduction of
# bucket ``b``, which then competes with that broadcast: each wait is stretched by the previous
# broadcast and backward stalls (the README measures a lag-1 hook slower than no hook at all).
# With a lag of 2, the reduction being waited for was queued before every broadcast
# issued since, and has had two buckets' worth of backward to complete.
_INTERLEAVE_LAG = 2


# [Note: Reduce to owner]
# With ``OverlapConfig.reduce_to_owner`` the wrapped hook (``allreduce_hook``) is not called for
# the gradients. Only the owner of a param needs its reduced gradient (it steps it, then
# broadcasts the new value), so each bucket is reduced to its owners: the bucket buffer is
# divided by the world size in place (exactly ``allreduce_hook``'s pre-division, so no overflow
# in fp16 and the same rounding of each addend), then one ``dist.reduce(SUM)`` per contiguous
# run of params sharing an owner, in ``bucket.parameters()`` order, with ``dst`` the owner's
# *global* rank (owners are group ranks, see shardkit-optim's [Note: Rank numbering]). Gloo's
# ``reduce_scatter`` (supported in torch 2.13) needs equal chunks per rank in rank order, which
# owner runs are not (whole buckets per rank, uneven splits, several runs per owner in DDP's
# first-iteration bucket), so ``reduce`` is used. Wire traffic: a reduce moves the bucket once,
# an all-reduce about twice (reduce-scatter + all-gather), so reduce + broadcast is ~2x the
# bucket bytes instead of ~3x.
# Exactness: the reduced values are the same pre-divided addends summed; only the summation
# order of the backend's reduce may differ from its all-reduce (bitwise equal at world 2, last
# bit at world >= 3). Everything else is unchanged: the owner steps from the reduced slice (see
# [Note: Reduced gradients at hook time]), the runs are computed per hook call from the bucket's
# actual params (DDP's first-iteration bucket and rebuilt ones alike, exact from step 1), and
# all reduces are issued by the autograd thread in bucket order before that call's broadcasts
# (see [Note: Gloo-safe scheduling]); their one callback only zeroes memory, never waits.
# What DDP writes into ``.grad``: the hook's returned future is the bucket buffer, which DDP
# copies into the grads (or which the grads view). On a non-destination rank a reduce leaves its
# input undefined, so once every reduce of the bucket has completed the callback zeroes the
# slices of params this rank does not own: after backward a rank's ``.grad`` holds the averaged
# gradient for the params it owns and zeros for the others. Reading a non-owned ``.grad`` is
# meaningless in this mode; so is accumulating grads over several *synchronised* backwards
# without ``zero_grad()`` (owners would add a zero instead of the others' previous average);
# accumulate with ``ddp.no_sync()`` as usual, which stays exact. Global-norm clipping and grad
# scalers need every reduced grad on every rank, so they are refused in this mode. With
# ``find_unused_parameters=True`` the deferred step (see [Note: Unused parameters]) reads the
# owned ``.grad`` after ``finalize_backward``, which holds the reduced value; globally unused
# params keep DDP's untouched ``.grad`` as with the all-reduce.


# [Note: Reduced gradients at hook time]
# When a bucket's reduction completes, the reduced values live in the hook future's result (a
# flat tensor laid out like ``bucket.buffer()``: params back to back in ``bucket.parameters()``
# order), not yet in ``p.grad``: DDP copies them there (``gradient_as_bucket_view=False``) or
# into the bucket buffer only in ``finalize_backward``, after every hook. For the step each owned
# param's ``.grad`` is pointed at its slice of that result, then restored; torch optimizers
# read ``p.grad`` only, so any optimizer works and multiple param groups too.


# [Note: Collective failures in the hooks]
# When a rank dies (or a collective fails) in the middle of a backward, the survivors' pending
# reductions and broadcasts complete with an error. Each such error must surface as that error,
# from ``backward()``, and never as a torch internal assert: every wait in a hook is wrapped
# (``_collective_failed`` names what failed and keeps the backend's message, e.g. Gloo's
# "Connection reset by peer"), and the last bucket's future never reads a future that may not
# have completed: ``collect_all`` completes early, with the first error, as soon as one of its
# futures fails, so its callback must re-raise that error instead of reading the reduction's
# value (which raised torch's "completed() INTERNAL ASSERT FAILED" here, hiding the cause).
def _collective_failed(exc: BaseException, what: str) -> RuntimeError:
    return RuntimeError(
        f"shardkit.overlap: {what} failed during backward: {type(exc).__name__}: {exc}\n"
        f"A rank of the process group has most likely died or stopped (its log shows why). This "
        f"rank's params and optimizer state may no longer match the other ranks': stop and "
        f"restart from a checkpoint."
    )


class ZeroOverlap:
    """A DDP comm hook running a :class:`~shardkit.optim.ShardedOptimizer` step per bucket.

    Built by :func:`hook_with_zero_step`, :func:`hook_with_zero_step_interleaved` or
    :func:`register_zero_overlap` (which also registers it); it is itself the hook to pass to
    ``ddp.register_comm_hook``. By the end of every ``backward()`` that synchronises gradients,
    the params are updated and identical on every rank, from the first iteration on.

    The loop keeps its ``zero.step()`` (or calls :meth:`step`): after such a backward it is a
    no-op, so the update is never applied twice (see shardkit-optim's [Note: Step drivers]).
    With a declared grad scaler or ``max_grad_norm`` the step runs in the loop instead (see
    [Note: Step placement]).
    """

    def __init__(
        self,
        hook: CommHook,
        ddp: DistributedDataParallel,
        zero: ShardedOptimizer,
        config: OverlapConfig,
        *,
        grad_scaler: Any = None,
        max_grad_norm: float | None = None,
    ) -> None:
        # See [Note: Registration agreement]: local checks first, their error kept, then one
        # all-ranks agreement step, so every rank raises the same error or none does.
        group = _agreement_group(ddp, zero)
        error: Exception | None = None
        signature: tuple[Any, ...] | None = None
        loop_step = False
        try:
            _check_types(hook, ddp, zero, config.shard_buckets)
            if not isinstance(config.interleaved, bool):
                raise TypeError(f"interleaved must be a bool, got {config.interleaved!r}")
            if zero in _BY_OPTIMIZER or ddp in _BY_DDP or zero.driver is not None:
                raise RuntimeError(
                    "an overlap hook is already built for this ShardedOptimizer or this DDP "
                    "model: DDP accepts one comm hook per model and the optimizer can be stepped "
                    "by one hook only. Build it once (call .close() on the old one if you really "
                    "need to replace it)."
                )
            loop_step = _check_supported(zero, grad_scaler, max_grad_norm)
            _check_reduce_to_owner(config.reduce_to_owner, hook, loop_step)
            _check_groups(ddp, zero)
            _check_params(_ddp_params(ddp), zero)
            signature = _registration_signature(
                zero,
                ddp,
                hook,
                config.interleaved,
                config.shard_buckets,
                loop_step,
                config.reduce_to_owner,
            )
        except Exception as exc:
            if group is None:  # no process group to agree over: nothing can be waiting
                raise
            error = exc
        if group is None:  # pragma: no cover (valid arguments always give a group)
            raise RuntimeError("no process group to register the overlap over")
        _agree_registration(error, zero if error is None else None, signature, group)
        # Collective from here on: every rank agreed, now every rank repartitions.
        _apply_partition(zero, _planned_partition(ddp, zero, config.shard_buckets))

        self.config = config
        self.zero = zero
        # DDP reads the hook's __name__ / __qualname__ (logging, bf16 checks).
        self.__name__ = f"zero_overlap_{getattr(hook, '__name__', type(hook).__name__)}"
        self.__qualname__ = self.__name__
        self._hook = hook
        self._ddp = weakref.ref(ddp)
        self._loop_step = loop_step
        self._deferred = bool(ddp.find_unused_parameters) and not loop_step
        self._scaler: torch.amp.GradScaler | None = grad_scaler if loop_step else None
        self._max_grad_norm = max_grad_norm
        self._rank = zero.rank
        self._layout: object = None
        self._owner: dict[int, int] = {}
        self._pending: list[tuple[int, list[torch.Tensor], torch.futures.Future[Any]]] = []
        self._works: list[dist.Work] = []
        self._next_index = 0
        self._stepped = False
        self._closed = False
        self.last_grad_norm: torch.Tensor | None = None
        """The total gradient norm before clipping of the latest :meth:`step` (``max_grad_norm``
        mode only)."""
        self._driver = _HookDriver(self, f"the shardkit-overlap hook {self.__name__}")
        if not loop_step:
            zero.attach_driver(self._driver)
        self._log_placement(max_grad_norm)
        _BY_OPTIMIZER[zero] = self
        _BY_DDP[ddp] = self

    def _log_placement(self, max_grad_norm: float | None) -> None:
        """Logs once per process when the step leaves the hooks (see [Note: Step placement])."""
        global _logged_loop_step, _logged_deferred
        if self._loop_step and not _logged_loop_step:
            _logged_loop_step = True
            why = " and ".join(
                w
                for w, on in (
                    (
                        "an enabled grad scaler",
                        self._scaler is not None and self._scaler.is_enabled(),
                    ),
                    (f"max_grad_norm={max_grad_norm}", max_grad_norm is not None),
                )
                if on
            )
            logger.info(
                "shardkit.overlap: %s declared, so the hooks only reduce and the sharded step "
                "runs in the training loop after backward (exact, not overlapped; logged once)",
                why,
            )
        if self._deferred and not _logged_deferred:
            _logged_deferred = True
            logger.info(
                "shardkit.overlap: DDP has find_unused_parameters=True, so the sharded step "
                "runs once after backward instead of per bucket (exact, not overlapped; "
                "logged once)"
            )

    # ------------------------------------------------------------------ public
    @property
    def stepped(self) -> bool:
        """Whether the hooks stepped the optimizer in the latest synchronised backward."""
        return self._stepped

    @property
    def loop_step(self) -> bool:
        """Whether the step runs in the loop (grad scaler / clipping declared) instead of the hooks."""
        return self._loop_step

    def step(self) -> None:
        """The training loop's optimizer step.

        When the hooks step (default): a no-op consuming the hooks' update, exactly like
        ``zero.step()``. In loop-step mode: unscale (declared scaler), clip to
        ``max_grad_norm`` (norm in :attr:`last_grad_norm`), then ``scaler.step(zero)`` or
        ``zero.step()``; call ``scaler.update()`` afterwards as usual.

        Raises:
            RuntimeError: no backward with gradient synchronisation ran since the previous
                step (e.g. only ``no_sync()`` backwards), so there is nothing to step.
        """
        if not self._loop_step:
            self.zero.step()
            return
        if self._scaler is not None:
            self._scaler.unscale_(self.zero)
        if self._max_grad_norm is not None:
            self.last_grad_norm = self.zero.clip_grad_norm(self._max_grad_norm)
        if self._scaler is not None:
            self._scaler.step(self.zero)
        else:
            self.zero.step()

    def close(self) -> None:
        """Stops stepping from the hook (it keeps reducing) and restores ``zero.step()``."""
        self._drain()
        if not self._closed and not self._loop_step:
            self.zero.detach_driver()
        self._closed = True
        _BY_OPTIMIZER.pop(self.zero, None)
        ddp = self._ddp()
        if ddp is not None:
            _BY_DDP.pop(ddp, None)

    # ------------------------------------------------------------------ hook
    def __call__(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The comm hook: reduce with the wrapped hook, step and broadcast owned params."""
        index = bucket.index()
        if index == 0:
            self._start_iteration()
        elif index != self._next_index:
            raise RuntimeError(
                f"DDP called the comm hook for bucket {index} but bucket {self._next_index} was "
                f"expected next (DDP launches buckets in index order); was a backward pass "
                f"interrupted?"
            )
        self._next_index = index + 1
        if self._closed or self._loop_step:
            with phase("reduce", index):  # See [Note: Profiler ranges] (shardkit-optim).
                return self._hook(state, bucket)
        if index == 0:
            # The hooks are about to step the shards: agree first (hyper-parameters, the call
            # itself), so a step one rank refuses moves no param on any rank (shardkit-optim's
            # [Note: Call agreement]). The loop's zero.step() agrees once more, cheaply.
            self.zero.check_step(self._unconsumed_error())
        with phase("reduce", index):
            if self.config.reduce_to_owner:
                fut = self._reduce_to_owners(bucket)  # See [Note: Reduce to owner].
            else:
                fut = self._hook(state, bucket)
        if self._deferred:
            # See [Note: Unused parameters].
            if index == 0:
                queue_end_of_backward(self._queue_deferred_step)
            return fut
        self._pending.append((index, bucket.parameters(), fut))
        last = bucket.is_last()
        # See [Note: Gloo-safe scheduling].
        if self.config.interleaved or last:
            keep = 0 if last else _INTERLEAVE_LAG
            while len(self._pending) > keep:
                done_index, params, done = self._pending.pop(0)
                self._step_and_broadcast(done_index, params, done)
        if not last:
            return fut
        self._next_index = 0
        self._stepped = True
        self._driver.mark_stepped()
        works, self._works = self._works, []
        if not works:
            return fut
        everything = torch.futures.collect_all([fut, *(w.get_future() for w in works)])

        def _finish(done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> Any:
            # See [Note: Collective failures in the hooks]: ``done`` may have completed early
            # with an error while ``fut`` is still pending; never read ``fut`` then.
            try:
                done.value()
            except Exception as exc:
                raise _collective_failed(
                    exc,
                    f"a reduction or parameter broadcast in flight at the last bucket ({index})",
                ) from exc
            return fut.value()

        return everything.then(_finish)

    # ------------------------------------------------------------------ internals
    def _unconsumed_error(self) -> str | None:
        """This rank's reason to refuse stepping in this backward: the previous synchronised
        backward's update was not consumed by a ``step()`` yet. With DDP two synchronised
        backwards accumulate ``avg(g1) + avg(g2)`` for one step; the hooks step inside each
        backward, so a second one would apply a second update. Raised on every rank by the
        agreement, before any reduction of this backward."""
        if not self._driver.marked:
            return None
        return (
            f"a second synchronised backward before optimizer.step(): {self._driver.name} steps "
            f"the optimizer inside each synchronised backward, so gradients of two backwards "
            f"cannot accumulate into one step as with plain DDP. Accumulate under ddp.no_sync() "
            f"(the last backward synchronises), or call zero.step() after every synchronised "
            f"backward"
        )

    def _start_iteration(self) -> None:
        self._drain()
        self._stepped = False
        layout = self.zero.shard_layout
        if layout is not self._layout:
            self._layout = layout
            self._owner = {id(p): o for p, o in zip(layout.params, layout.owner, strict=True)}

    def _drain(self) -> None:
        """Finishes what a backward that stopped half-way (an exception) left in flight."""
        works, self._works = self._works, []
        self._pending = []
        self._next_index = 0
        for w in works:
            try:
                w.wait()
            except Exception as exc:  # See [Note: Collective failures in the hooks].
                raise _collective_failed(
                    exc, "a parameter broadcast left over from an interrupted backward"
                ) from exc

    def _reduce_to_owners(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Averages ``bucket`` onto the owners of its params. See [Note: Reduce to owner]."""
        buffer = bucket.buffer()
        index = bucket.index()
        group = self.zero.group
        buffer.div_(self.zero.world_size)
        runs: list[list[int]] = []  # [owner, lo, hi] in buffer order
        offset = 0
        for p in bucket.parameters():
            owner, n = self._owner[id(p)], p.numel()
            if runs and runs[-1][0] == owner:
                runs[-1][2] = offset + n
            else:
                runs.append([owner, offset, offset + n])
            offset += n
        futs: list[torch.futures.Future[Any]] = []
        for owner, lo, hi in runs:
            work = dist.reduce(
                buffer[lo:hi],
                dst=dist.get_global_rank(group, owner),
                op=dist.ReduceOp.SUM,
                group=group,
                async_op=True,
            )
            if work is None:
                raise RuntimeError("an async reduce returned no work handle")
            futs.append(work.get_future())
        foreign = [(lo, hi) for owner, lo, hi in runs if owner != self._rank]

        def _finish(done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
            # Runs once every reduce of the bucket completed; only zeroes memory (value()
            # of a completed future re-raises its error, it does not wait).
            try:
                for f in done.value():
                    f.value()
            except Exception as exc:  # See [Note: Collective failures in the hooks].
                raise _collective_failed(
                    exc, f"the reduction to the owners of bucket {index}"
                ) from exc
            for lo, hi in foreign:
                buffer[lo:hi].zero_()
            return buffer

        return torch.futures.collect_all(futs).then(_finish)

    def _step_and_broadcast(
        self, index: int, params: Sequence[torch.Tensor], fut: torch.futures.Future[Any]
    ) -> None:
        owners = [self._owner[id(p)] for p in params]
        if self._rank in owners:
            try:
                with phase("wait", index):
                    result = fut.wait()
            except Exception as exc:  # See [Note: Collective failures in the hooks].
                raise _collective_failed(exc, "a gradient reduction") from exc
            flat = result if isinstance(result, torch.Tensor) else result[0]
            # See [Note: Reduced gradients at hook time].
            saved: list[tuple[torch.Tensor, torch.Tensor | None]] = []
            offset = 0
            try:
                for p, owner in zip(params, owners, strict=True):
                    n = p.numel()
                    if owner == self._rank:
                        g = flat.narrow(0, offset, n).view(p.shape)
                        saved.append((p, p.grad))
                        p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
                    offset += n
                with phase("local_step", index):
                    self.zero.step_local([p for p, _ in saved])
            finally:
                for p, g0 in saved:
                    p.grad = g0
        # One broadcast per (bucket, owner) run of the flat buffers; see [Note: Gloo-safe
        # scheduling].
        with phase("sync", index):
            self._works.extend(self.zero.sync_params(params, async_op=True))

    def _queue_deferred_step(self) -> None:
        queue_end_of_backward(self._deferred_step)

    # [Note: Unused parameters]
    # With find_unused_parameters=True a param may get no gradient in an iteration; plain DDP
    # then leaves its ``.grad`` as it was (None) when no rank used it, and a torch optimizer skips
    # it (no update, no state change). Which params no rank used is only known once DDP has
    # all-reduced its usage map, after the last bucket. So in this mode the step cannot run per
    # bucket: the hook queues, at the first bucket, a backward callback that queues another
    # one; the second runs after DDP's ``finalize_backward`` (queued in between), when every
    # ``.grad`` is final, and performs the sharded step and broadcast there. The result is exact;
    # the overlap is lost for such models (reductions still overlap backward as usual).
    def _deferred_step(self) -> None:
        with phase("local_step"):
            self.zero.step_local()
        with phase("sync"):
            self.zero.sync_params()
        self._next_index = 0
        self._stepped = True
        self._driver.mark_stepped()


class _HookDriver(StepDriver):
    """How the hook drives ``zero.step()`` (shardkit-optim's [Note: Step drivers]).

    The hooks step the shard inside backward; the training loop keeps its ``zero.step()`` (so
    LR schedulers and GradScaler see a step), which consumes the mark the last bucket left and
    runs the per-step agreement, so the update is never applied twice. Without a mark it raises
    on every rank: the gradients were not reduced (only ``no_sync()`` backwards ran) or the
    update was already consumed. A closure would run another backward, i.e. another hook step,
    so it is refused.
    """

    def __init__(self, hook: ZeroOverlap, name: str) -> None:
        self.name = name
        self._hook = weakref.ref(hook)
        self._marked = False

    def mark_stepped(self) -> None:
        """The hooks stepped every param of this backward."""
        self._marked = True

    @property
    def marked(self) -> bool:
        """Whether the hooks stepped in a backward whose update no ``step()`` consumed yet."""
        return self._marked

    def step(self, closure: Any = None, **kwargs: Any) -> None:
        hook = self._hook()
        rank = hook.zero.rank if hook is not None else -1
        error = None
        if closure is not None:
            error = (
                f"ShardedOptimizer.step(closure) while {self.name} steps this optimizer from "
                f"its comm hook: the closure's backward would step it a second time. Run the "
                f"forward/backward in the loop and call step() without a closure."
            )
        elif not self._marked:
            error = (
                f"ShardedOptimizer.step(): {self.name} steps this optimizer from DDP's comm "
                f"hook, and no backward pass with gradient synchronisation ran on rank {rank} "
                f"since the last step (under ddp.no_sync() the comm hooks do not run, and each "
                f"backward's update is consumed by one step() call). Run a synchronised "
                f"backward first."
            )
        if hook is not None:
            hook.zero.check_step(error)
        self._marked = False
