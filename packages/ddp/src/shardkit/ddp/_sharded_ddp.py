"""``ShardedDataParallel``: ZeRO-2 data parallelism that moves exactly DDP's bytes.

How the wrapped optimizers are driven: [Note: Optimizer hand-over] in ``shardkit.ddp._unit``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from shardkit.ddp._checks import (
    agree_plan,
    agree_structure,
    cap_bytes,
    check_params,
    optimizers_of,
    reduce_dtype_of,
)
from shardkit.ddp._comm import CommStats, _Comm
from shardkit.ddp._gather import _ParamGather
from shardkit.ddp._layout import _Bucket
from shardkit.ddp._module_copy import _Hook, make_deepcopy_plain
from shardkit.ddp._profiling import phase
from shardkit.ddp._reducer import _Reducer, check_clip, is_placeholder
from shardkit.ddp._unit import _Host, _Unit
from shardkit.optim import (
    ShardedOptimizer,
    ShardStepper,
    agree_call,
    agree_grad_norm,
    build_flat_buckets,
    check_clip_args,
    gather_full_state_dict,
    grad_norm_partial,
    is_elementwise,
    load_full_state_dict,
    register_call,
)
from shardkit.partition import check_consistent
from torch import nn

__all__ = ["ShardedDataParallel"]

logger = logging.getLogger("shardkit.ddp")

# Collective phases of the wrapper, agreed between ranks: see [Note: Wrapper agreements].
_BACKWARD = register_call("ShardedDataParallel backward (gradient reduce-scatter)")
_FORWARD = register_call("ShardedDataParallel forward (buffer broadcast)")
_REDUCE = register_call("ShardedDataParallel.reduce()")
_CLIP = register_call("ShardedDataParallel.clip_grad_norm_()")
_STATE_DICT = register_call("ShardedDataParallel.optimizer_state_dict()")
_REFRESH = register_call("ShardedDataParallel.refresh_trainable()")


class ShardedDataParallel(nn.Module):
    """Data parallelism with sharded gradients and optimizer state (ZeRO-2).

    Gradients are reduce-scattered bucket by bucket during backward into the shard of the rank
    that owns them; ``optimizer.step()`` steps every rank's shard and all-gathers the params.
    Per step each rank sends what DDP's all-reduce sends, holds ``1/N`` of the gradients and of
    the optimizer state (and of the fp32 masters with ``master_dtype``), plus a pool of at most
    two staging buckets (see [Note: Staging lifetime] in ``shardkit.ddp._reducer``).
    See [Note: Owner-contiguous buckets] (``shardkit.optim._flat``) for the layout and
    [Note: Optimizer hand-over] (``shardkit.ddp._unit``) for how the optimizers are driven.

    Gradients and clipping: after a synchronised backward a param's ``.grad`` is a memory-less
    placeholder of its shape and dtype (the reduced gradient lives in the owners' shards), on
    which every torch op raises: ``torch.nn.utils.clip_grad_norm_(module.parameters(), ...)``
    raises a RuntimeError instead of returning 0.0 and clipping nothing. Clip with
    :meth:`clip_grad_norm_` (or ``optimizer.clip_grad_norm``) after backward and before
    ``step()``; it raises after ``step()`` or when called twice. Backwards under
    :meth:`no_sync` leave full local gradients in ``.grad``, as DDP does. See [Note:
    Reduced-grad placeholders] in ``shardkit.ddp._reducer``.

    ``copy.deepcopy`` of the wrapped module gives a plain module (finished params, no hooks,
    no process group), as under DDP; see [Note: Plain deepcopy] in ``shardkit.ddp._module_copy``.

    Args:
        module: the model, already on its device, identical on every rank (or synchronised
            with ``sync_models_at_startup``).
        sharded_optimizer: a ``shardkit.optim.ShardedOptimizer`` (or ``OSS``) over the
            module's trainable params, or a list of them over disjoint params (fairscale's
            several optimizers), all over the same process group; each one's ``step()`` steps
            and gathers its own params.
        process_group: must be ``None`` or the optimizers' group.
        broadcast_buffers: broadcast rank 0's buffers before every forward, like DDP.
        sync_models_at_startup: broadcast rank 0's params and buffers at construction.
        reduce_buffer_size: fairscale's bucket size in elements (fp32, 4 bytes each); ``None``
            uses ``bucket_cap_mb``; ``0`` puts every param in its own bucket.
        auto_refresh_trainable: a change of ``requires_grad`` (on every rank alike) is picked
            up by the next training forward, which rebuilds the bucket layout and keeps the
            optimizer state (fairscale's behaviour; see :meth:`refresh_trainable`). With
            ``False``, call :meth:`refresh_trainable` yourself; a step after an unrefreshed
            change raises on every rank.
        reduce_fp16: fairscale's flag: ``True`` is ``reduce_dtype=torch.float16``.
        warn_on_trainable_params_changed: accepted for fairscale compatibility.
        bucket_cap_mb: bucket cap in MiB (DDP's default 25).
        first_bucket_cap_mb: cap of the first bucket of each group (DDP's 1), so the first
            reduction starts early in backward.
        elementwise: ``None`` shards the param groups of the torch optimizers in
            ``shardkit.ddp.ELEMENTWISE_OPTIMIZERS`` element by element and gives whole params
            to owners for any other optimizer (Muon, Shampoo-like); ``True`` / ``False``
            forces one way.
        overlap_param_gather: ``True`` (default): the param all-gathers of ``step()`` are
            left in flight, in forward order, and a forward pre-hook of each submodule waits
            only for the buckets of its own params, so the gathers overlap the next forward
            (FSDP2's prefetch, Megatron's overlap-param-gather). Invisible to the user: until
            the last gather is waited for, any torch function on the training thread that
            touches a param whose gather is pending (through any module, reference, view or
            ``.data`` alias: an EMA update, a norm, an in-place clamp, ``load_state_dict``, a
            functional use in forward) waits for it first, so it reads and writes what DDP
            would show. Another thread, raw pointers and C++ extensions are not seen: call
            :meth:`wait_params` before them. ``False``: ``step()`` returns once every param is
            gathered. See [Note: Deferred param gather] in ``shardkit.ddp._gather`` and
            [Note: Param access guard] in ``shardkit.ddp._guard``.
        reduce_dtype: the dtype gradients are staged and reduce-scattered in (``None``: each
            bucket's own dtype). ``torch.float16`` / ``torch.bfloat16`` on an fp32 model halve
            the bytes on the wire (like DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``);
            ``torch.float32`` on a bf16 model sums in fp32. The reduced shard is kept in the
            params' dtype. See [Note: Reduce dtype] in ``shardkit.ddp._reducer``.
        keep_staging_buffers: ``True`` (default): the (at most two) bucket-sized staging
            buffers are allocated by the first backward and kept from one step to the next,
            so no later step allocates a bucket-sized tensor (the local step borrows them as
            its scratch); they cost two buckets of memory between steps (2 x 25 MiB with the
            default cap), which a CPU process keeps resident either way (glibc does not give
            freed pages back). ``False`` frees them once the step has waited for the last
            reduction, so between steps a rank holds params, grad shards and optimizer state
            only: on CUDA the caching allocator lends those blocks to the next forward's
            activations; every backward allocates them again (on CPU, fresh pages each step).
            See [Note: Staging lifetime] in ``shardkit.ddp._reducer``.
        gradient_as_bucket_view: ``True``: in a synchronised backward each param's ``.grad``
            is a zeroed view of its bucket's staging buffer, which ``AccumulateGrad`` adds the
            gradient into, so there is no staging copy (DDP's option of that name). ``False``
            (default): the post-accumulate hook copies the gradient, times ``1/N``, into the
            buffer. Same bits, same memory; the copy moves fewer bytes (one multiply-copy
            against a zero, an add and a scale), so it is the default. See [Note: Gradients as bucket
            views] in ``shardkit.ddp._reducer``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or the optimizer not a ShardedOptimizer.
        ValueError: bad arguments, optimizer params that are not the module's trainable
            params, or ranks that disagree on the params or the bucket plan (on every rank).
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: ShardedOptimizer | Sequence[ShardedOptimizer],
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int | None = None,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        elementwise: bool | None = None,
        overlap_param_gather: bool = True,
        reduce_dtype: torch.dtype | None = None,
        keep_staging_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        opts = optimizers_of(sharded_optimizer)
        if process_group is not None and process_group is not opts[0].group:
            raise ValueError(
                "process_group must be None or the ShardedOptimizer's group: gradients are "
                "reduced over the group the optimizer shards over. Build the optimizer with "
                "group=process_group."
            )
        reduce_dtype = reduce_dtype_of(reduce_fp16, reduce_dtype)
        for name, flag in (
            ("keep_staging_buffers", keep_staging_buffers),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
        ):
            if not isinstance(flag, bool):
                raise TypeError(
                    f"{name} must be a bool, got {type(flag).__name__}: {flag!r}; pass True or "
                    f"False"
                )
        if elementwise is not None and not isinstance(elementwise, bool):
            raise TypeError(f"elementwise must be None or a bool, got {elementwise!r}")
        cap = cap_bytes(reduce_buffer_size, bucket_cap_mb, "bucket_cap_mb")
        first_cap = min(cap, cap_bytes(None, first_bucket_cap_mb, "first_bucket_cap_mb"))
        self.module = module
        self.sharded_optimizers: list[ShardedOptimizer] = opts
        """The wrapped optimizers (fairscale's attribute), in the order given."""
        self.group: dist.ProcessGroup = opts[0].group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.auto_refresh_trainable = auto_refresh_trainable
        self.warn_on_trainable_params_changed = warn_on_trainable_params_changed
        self.reduce_dtype = reduce_dtype
        self._comm = _Comm(self.group)
        check_params(module, [o.param_groups for o in opts])
        agree_structure(module, opts[0].group)  # before any collective on params/buffers
        params = [p for o in opts for g in o.param_groups for p in g["params"]]
        check_consistent(params, group=self.group)
        self._cap = (cap, first_cap)
        self._elementwise = elementwise
        self._host = _Host(
            self.rank,
            self.world_size,
            self._step_unit,
            self._zero_grad_units,
            self._clip_units,
            self._finish_reductions,
            self.optimizer_state_dict,
            self.load_optimizer_state_dict,
        )
        self._keep_staging = keep_staging_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        """See [Note: Gradients as bucket views] in ``shardkit.ddp._reducer``."""
        self._no_sync_entries = 0
        self._no_sync = False
        self._sync_buffers_next = True  # DDP's require_forward_param_sync
        self._units: list[_Unit] = []
        self._grad_hooks: list[Any] = []
        if not isinstance(overlap_param_gather, bool):
            raise TypeError(f"overlap_param_gather must be a bool, got {overlap_param_gather!r}")
        self.overlap_param_gather = overlap_param_gather
        self._gather = _ParamGather(self._comm, self.rank, overlap_param_gather)
        self._build(sync_models_at_startup)
        self.last_closure_loss: Any = None
        devices = {p.device for p in params}
        self.is_multi_device_module = len(devices) > 1
        self.device_type = next(iter(devices)).type if devices else "cpu"
        self._handles: list[Any] = []
        for sub in module.modules():
            if sub is module or next(sub.parameters(recurse=False), None) is not None:
                # See [Note: Deferred param gather] in shardkit.ddp._gather: every module that
                # holds params waits before its forward, its state_dict() and load_state_dict()
                hooked = cast(Any, sub)
                self._handles += [
                    hooked.register_forward_pre_hook(_Hook(self._pre_forward)),
                    hooked.register_state_dict_pre_hook(_Hook(self._before_state_dict)),
                    hooked.register_load_state_dict_pre_hook(_Hook(self._before_state_dict)),
                ]
                make_deepcopy_plain(sub, self.wait_params)  # See [Note: Plain deepcopy]
        for unit in self._units:  # See [Note: Optimizer hand-over]
            unit.opt.attach_driver(unit)
        self._comm.stats.reset()

    def _build(self, sync: bool) -> None:
        """Plans the buckets of the trainable params, re-points them into the flat buffers, and
        builds (or, on :meth:`refresh_trainable`, rebuilds) the steppers, the reducer and its
        gradient hooks. Collective (the plan agreement, the startup broadcast)."""
        cap, first_cap = self._cap
        opts = self.sharded_optimizers
        buckets: list[_Bucket] = []
        spans: list[tuple[int, int]] = []
        prints: list[str] = [f"reduce_dtype={self.reduce_dtype}"]
        for k, o in enumerate(opts):
            flags = [is_elementwise(type(o.optim), self._elementwise)] * len(o.param_groups)
            mine, group_prints = build_flat_buckets(
                o.param_groups, flags, self.world_size, cap, first_cap,
                first_index=len(buckets), bucket_type=_Bucket,
            )  # fmt: skip
            for bucket in mine:
                bucket.reset_backward()
            spans.append((len(buckets), len(buckets) + len(mine)))
            buckets += mine
            prints += [f"optimizer {k}: {fp}" for fp in group_prints]
        agree_plan(prints, self.group)
        self._buckets = buckets
        if sync:
            self._sync_at_startup([p for o in opts for g in o.param_groups for p in g["params"]])
        for k, (o, (a, b)) in enumerate(zip(opts, spans, strict=True)):
            stepper = ShardStepper(
                buckets[a:b], type(o.optim), o.param_groups, dict(o.defaults), self.rank,
                o.master_dtype,
            )  # fmt: skip
            if k < len(self._units):
                self._units[k].rebuild(buckets[a:b], stepper)
            else:
                self._units.append(_Unit(self._host, k, o, buckets[a:b], stepper))
        for h in self._grad_hooks:
            h.remove()
        self._reducer = _Reducer(
            buckets,
            self._comm,
            self.reduce_dtype,
            keep_pool=self._keep_staging,
            scratch_bytes=max((u.stepper.scratch_bytes() for u in self._units), default=0),
        )
        self._reducer.bucket_views = self.gradient_as_bucket_view
        self._reducer.enabled = not self._no_sync
        self._reducer.on_backward_start = lambda: self._agree_reduction(_BACKWARD)
        # See [Note: Reduced-grad placeholders] in shardkit.ddp._reducer
        self._grad_hooks = self._reducer.register_hooks()
        self._gather.rebuild(buckets, self.module)
        self._trainable = [p.requires_grad for p in self.module.parameters()]

    # ------------------------------------------------------------------ set-up
    def _sync_at_startup(self, params: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for b in self._buckets:
                self._comm.broadcast(b.flat, 0)
            bucketed = {id(p) for b in self._buckets for p in b.params}
            for p in params:
                if id(p) not in bucketed:
                    self._comm.broadcast(p.data, 0)
            for buf in self.module.buffers():
                self._comm.broadcast(buf, 0)

    @property
    def sharded_optimizer(self) -> ShardedOptimizer:
        """The wrapped optimizer, when there is exactly one (else see ``sharded_optimizers``).

        Raises:
            RuntimeError: several optimizers are wrapped.
        """
        if len(self.sharded_optimizers) != 1:
            raise RuntimeError(
                f"this ShardedDataParallel wraps {len(self.sharded_optimizers)} optimizers: "
                f"use sharded_optimizers[k]"
            )
        return self.sharded_optimizers[0]

    def __getattr__(self, name: str) -> Any:
        """Attributes of the wrapped module are reachable through the wrapper (fairscale)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module" or (name.startswith("__") and name.endswith("__")):
                raise  # protocols (__deepcopy__, ...) are the wrapper's own, never the module's
            return getattr(self.module, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedDataParallel:
        """Refuses: the wrapper holds a process group and this rank's shards.

        Raises:
            TypeError: always; deep-copy the wrapped module instead (a plain module, see
                [Note: Plain deepcopy] in ``shardkit.ddp._module_copy``).
        """
        raise TypeError(
            "copy.deepcopy of a ShardedDataParallel is not supported (it holds a process group "
            "and this rank's gradient and optimizer shards); copy the wrapped module instead: "
            "copy.deepcopy(ddp.module) gives a plain nn.Module with the current params"
        )

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the module (after broadcasting rank 0's buffers when ``broadcast_buffers``).

        [Note: Buffer broadcast like DDP]
        DDP broadcasts the buffers before a forward only if the *previous* forward ran with
        grad enabled outside ``no_sync()`` (its ``require_forward_param_sync``; true before
        the first forward). The same rule here keeps every rank issuing the same broadcasts
        as DDP would, and the buffers equal to DDP's, bit for bit.

        Raises:
            RuntimeError: in training with grad enabled, a param's ``.grad`` requires grad
                (double backward, ``create_graph=True``), which sharded gradients do not support.
        """
        if self.training and torch.is_grad_enabled():
            for b in self._buckets:
                for p in b.params:
                    if p.grad is not None and p.grad.requires_grad:
                        raise RuntimeError(
                            f"a param of shape {tuple(p.shape)} has a .grad that requires grad "
                            f"(double backward / create_graph=True): ShardedDataParallel reduces "
                            f"detached gradients; use torch DDP for higher-order gradients"
                        )
            if self.auto_refresh_trainable and any(
                p.requires_grad != t
                for p, t in zip(self.module.parameters(), self._trainable, strict=True)
            ):
                self.refresh_trainable()  # See [Note: Trainable refresh]
        if self._reducer.in_backward and not self._reducer.inflight:
            self._reducer.in_backward = False  # the last backward raised before its end
        buffers = list(self.module.buffers()) if self.broadcast_buffers else []
        if buffers and self._sync_buffers_next:
            self._agree(_FORWARD)  # See [Note: Wrapper agreements]
            with torch.no_grad(), phase("broadcast_buffers"):
                for buf in buffers:
                    self._comm.broadcast(buf, 0)
        out = self.module(*args, **kwargs)
        self._sync_buffers_next = torch.is_grad_enabled() and not self._no_sync
        return out

    # [Note: Trainable refresh]
    # The bucket layout holds the params that were trainable when it was built. A change of
    # ``requires_grad`` is picked up by the next training forward (``auto_refresh_trainable``,
    # fairscale's behaviour; else by an explicit ``refresh_trainable()``), which rebuilds the
    # layout on every rank: agree on the new flags (bounded: a rank that did not change them is
    # in another call and every rank raises), wait for the reductions and gathers, take each
    # optimizer's full state dict (collective), give the params that left the layout their own
    # storage, re-plan the buckets, and load the state dicts back into the new pieces. So the
    # optimizer state of the params that stay trainable survives, bit for bit, and a param that
    # becomes trainable starts with no state, as with a plain optimizer. It costs the full state
    # on every rank for the moment of the rebuild. A change made after a forward is refused at
    # the next step (the layout of that backward was the old one).
    def refresh_trainable(self) -> None:
        """Rebuilds the bucket layout after ``requires_grad`` changed. Collective.

        Called by the next training forward when ``auto_refresh_trainable`` (default); see
        [Note: Trainable refresh].

        Raises:
            ValueError: ranks changed ``requires_grad`` differently (on every rank).
            RuntimeError: reduced gradients wait for a step (call ``step()`` or
                ``zero_grad()`` first), or the ranks are not all refreshing.
        """
        flags = [p.requires_grad for p in self.module.parameters()]
        digest = int.from_bytes(hashlib.sha256(bytes(flags)).digest()[:7], "big")
        if not self._agree(_REFRESH, digest=digest):
            raise ValueError(
                "ShardedDataParallel.refresh_trainable(): ranks changed requires_grad on "
                "different params; every rank must freeze and unfreeze the same params"
            )
        if any(not b.grad_fresh for b in self._buckets):  # agreed: launches are collective
            raise RuntimeError(
                "requires_grad changed while reduced gradients wait for optimizer.step(): call "
                "step() or zero_grad() before changing which params train"
            )
        check_params(self.module, [o.param_groups for o in self.sharded_optimizers])
        # each optimizer_state_dict() waits for the reductions and the param gathers first
        states = [self.optimizer_state_dict(u.index) for u in self._units]
        with torch.no_grad():
            for b in self._buckets:
                for p in b.params:
                    p.data = p.data.clone()  # off the old flat buffer
        self._build(sync=False)
        for u, sd in zip(self._units, states, strict=True):
            self.load_optimizer_state_dict(sd, u.index)
        logger.info(
            "ShardedDataParallel: requires_grad changed, bucket layout rebuilt (%d trainable "
            "params, %d buckets)",
            sum(flags),
            len(self._buckets),
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate full local gradients in ``.grad`` without communicating;
        the next synchronised backward reduces the sum once (like DDP and fairscale, this needs
        a full-size local gradient while accumulating)."""
        old = self._no_sync
        self._no_sync = True
        self._no_sync_entries += 1  # agreed at the next reduction: see _agree_reduction
        self._reducer.enabled = False
        try:
            yield
        finally:
            self._no_sync = old
            self._reducer.enabled = not old

    def reduce(self) -> None:
        """Reduces the gradients accumulated in ``.grad`` (under ``no_sync()``) now, outside a
        backward pass (fairscale's manual reduction). Collective."""
        if self._reducer.in_backward:
            raise RuntimeError("ShardedDataParallel.reduce() cannot run inside a backward pass")
        self._agree_reduction(_REDUCE)
        self._reducer.start_pass()
        self._reducer.flush()

    # ------------------------------------------------------------------ agreement
    # [Note: Wrapper agreements]
    # Every collective phase of the wrapper starts with shardkit-optim's bounded call agreement
    # (its [Note: Call agreement]), so ranks that are not in the same phase raise on every rank,
    # naming the phases, within ``collective_timeout`` (default 30 s), instead of pairing
    # mismatched collectives (a Gloo abort) or waiting for the process group's timeout:
    # the buffer broadcast before a forward, the first gradient of every synchronised backward
    # (which also agrees on how many ``no_sync()`` blocks each rank entered since the last
    # reduction), ``reduce()``, ``clip_grad_norm_()``, ``optimizer_state_dict()``; the step
    # agrees through ``ShardedOptimizer.check_step``. Each is one exchange on the c10d store
    # (shardkit-optim's [Note: Agreement over the store]): no collective, nothing left pending
    # when it raises, so a rank that raised can exit.
    def _agree(self, call: str, digest: int = 0) -> bool:
        opt = self.sharded_optimizers[0]
        same, _, _ = agree_call(call, self.group, opt.collective_timeout, digest=digest)
        return bool(same)

    def _agree_reduction(self, call: str) -> None:
        entries, self._no_sync_entries = self._no_sync_entries, 0
        if not self._agree(call, digest=entries):
            raise RuntimeError(
                f"{call}: ranks entered no_sync() a different number of times since the last "
                f"reduction (this rank: {entries}); every rank must accumulate under no_sync() "
                f"alike, or the reduced gradients mix different numbers of micro-batches"
            )

    # ------------------------------------------------------------------ step
    def _step_unit(self, unit: _Unit, closure: Any) -> Any:
        """``unit``'s optimizer's ``step(closure)``; see [Note: Optimizer hand-over].

        A closure (fairscale's loops pass one) is evaluated first, once; its loss is returned
        and kept in :attr:`last_closure_loss`. Both agreements run before any shard moves.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.last_closure_loss = loss
        with phase("step"):  # See [Note: Profiler ranges] in shardkit.ddp._profiling
            # Hyper-parameters, requires_grad and the call itself, agreed before any shard
            # moves (shardkit-optim's [Note: Call agreement]).
            unit.opt.check_step(self._trainable_error(unit))
            self.wait_params()
            self._reducer.wait_inflight()  # the pool stays for the step's scratch
            unused = self._global_unused(unit.buckets)
            with phase("local_step"):  # See [Note: Staging lifetime] in shardkit.ddp._reducer
                scratch = self._reducer.idle_buffers()
                unit.stepper.step(unit.opt.param_groups, unused, scratch=scratch)
            self._reducer.consume(unit.buckets)
            self._reducer.trim_pool()
            with phase("all_gather"):
                self._gather.issue(unit.buckets)
        return loss

    def _global_unused(self, buckets: Sequence[_Bucket]) -> set[tuple[int, int]]:
        """``(bucket index, position)`` of the params of ``buckets`` that no rank used since
        the last step: one all-reduce (MAX) of a byte per param. See [Note: Per-param
        fragments] in ``shardkit.optim._shard_stepper``."""
        live = [b for b in buckets if not b.grad_fresh]
        if not live:  # nothing reduced since the last step (agreed: launches are collective)
            return set()
        used = [i in b.used for b in live for i in range(len(b.params))]
        mask = torch.tensor(used, dtype=torch.uint8, device=live[0].device)
        with phase("usage"):
            self._comm.all_reduce(mask, op=dist.ReduceOp.MAX)
        if all(used):  # this rank used every param: so did the union
            return set()
        flags = iter(mask.tolist())
        return {(b.index, i) for b in live for i in range(len(b.params)) if not next(flags)}

    def _finish_reductions(self) -> None:
        """Waits for every in-flight reduce-scatter."""
        self._reducer.finish_all()

    def _trainable_error(self, unit: _Unit) -> str | None:
        """This rank's reason to refuse the step if ``requires_grad`` changed since
        construction; raised on every rank by the optimizer's per-step agreement."""
        changed = [
            i
            for i, (p, t) in enumerate(zip(unit.params(), unit.trainable, strict=True))
            if p.requires_grad != t
        ]
        if not changed:
            return None
        return (
            f"requires_grad changed after ShardedDataParallel was built, on rank {self.rank} "
            f"(params {changed[:5]}, global indices) after the last forward, or with "
            f"auto_refresh_trainable=False: the gradients were reduced in the old bucket layout. "
            f"Change requires_grad before a forward (on every rank alike), or call "
            f"ddp.refresh_trainable() after changing it"
        )

    def wait_params(self) -> None:
        """Waits for every param all-gather still in flight.

        Torch functions on the training thread wait by themselves ([Note: Param access guard]
        in ``shardkit.ddp._guard``); call this before params are read where no torch function
        is seen: from another thread, through a raw pointer or a C++ extension.
        """
        self._gather.wait_all()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._gather.before_module(module)

    def _before_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.wait_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops every gradient: reduced shards and ``.grad`` left by ``no_sync()``."""
        self._zero_grad_units(self._units, set_to_none, self.module.parameters())

    def _zero_grad_units(
        self,
        units: Sequence[_Unit],
        set_to_none: bool,
        params: Iterable[torch.Tensor] | None = None,
    ) -> None:
        """Drops the reduced gradients of ``units`` and the ``.grad`` of ``params`` (default:
        the units' params)."""
        self._reducer.finish_all()  # not the param gathers: see [Note: Deferred param gather]
        for unit in units:
            self._reducer.consume(unit.buckets)
            unit.stepper.factors.clear()
        for p in params if params is not None else (p for u in units for p in u.params()):
            if p.grad is not None:
                if set_to_none or is_placeholder(p.grad):  # the shard it stood for is consumed
                    p.grad = None  # See [Note: Reduced-grad placeholders]
                else:
                    p.grad.zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the reduced gradients by their global norm (over every rank's shard).

        Collective. Call after backward and before ``step()``. Returns the total norm. With
        several optimizers, the norm is over all of them (``optimizer.clip_grad_norm`` clips
        one optimizer's params by their own norm, as fairscale's OSS does). This is the clip
        to use under this wrapper: ``torch.nn.utils.clip_grad_norm_(module.parameters())``
        raises (see the class docstring).

        The norm is shardkit-optim's (its [Note: Sharded grad norm]): fp32 norms of short
        blocks combined in fp64, as accurate as an fp64 reference to rtol 1e-6.

        Raises:
            TypeError: ``max_norm`` or ``norm_type`` is not a number.
            ValueError: on every rank, when ranks pass different ``(max_norm, norm_type)``
                (naming each rank's values), or invalid ones.
            RuntimeError: on every rank, when no gradient was reduced since the last
                ``step()`` / ``zero_grad()`` (e.g. called after the step), when these
                gradients were already clipped (called twice), or when ranks disagree on
                either. See [Note: Clip agreement] in ``shardkit.ddp._reducer``.
        """
        return self._clip_units(self._units, max_norm, norm_type)

    def _clip_units(
        self, units: Sequence[_Unit], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        max_f, norm_f = check_clip_args(max_norm, norm_type)
        self._agree(_CLIP)  # See [Note: Wrapper agreements]
        with phase("clip_grad_norm"):
            self._reducer.finish_all()
            self.wait_params()
            device = self._buckets[0].device if self._buckets else torch.device("cpu")
            scratch = self._reducer.idle_buffers()  # See [Note: Staging lifetime]
            # shardkit-optim's one clip (its [Note: Sharded grad norm]): fp32 block norms, an
            # fp64 partial, one all-gather of one row per rank through the counting layer. The
            # flags ride in the row (see [Note: Clip agreement] in shardkit.ddp._reducer).
            norms = [n for u in units for n in u.stepper.grad_norms(u.buckets, norm_f, scratch)]
            buckets = [b for u in units for b in u.buckets]
            norm = agree_grad_norm(
                grad_norm_partial(norms, norm_f, device),
                max_f,
                norm_f,
                self.group,
                flags=self._reducer.clip_flags(buckets),
                all_gather=self._comm.all_gather_into,
            )
            check_clip(norm.flags)
            for u in units:
                u.stepper.apply_clip(u.buckets, norm.coef)
            self._reducer.mark_clipped(buckets)
            return norm.total

    # ------------------------------------------------------------------ state
    def _unit(self, optimizer: int | ShardedOptimizer | None) -> _Unit:
        if optimizer is None:
            if len(self._units) != 1:
                raise ValueError(
                    f"this ShardedDataParallel wraps {len(self._units)} optimizers: name one "
                    f"(optimizer=k or the optimizer itself)"
                )
            return self._units[0]
        for u in self._units:
            if optimizer is u.opt or (
                isinstance(optimizer, int)
                and not isinstance(optimizer, bool)
                and optimizer == u.index
            ):
                return u
        raise ValueError(
            f"optimizer must be None, an index below {len(self._units)} or one of the wrapped "
            f"optimizers, got {optimizer!r}"
        )

    def optimizer_state_dict(
        self, optimizer: int | ShardedOptimizer | None = None
    ) -> dict[str, Any]:
        """The full state dict of a wrapped optimizer (``None``: the only one; else its index
        or itself) in plain torch format, on every rank. Collective.

        See [Note: Optimizer state format] in ``shardkit.optim._shard_state``.
        """
        unit = self._unit(optimizer)
        self._agree(_STATE_DICT)  # See [Note: Wrapper agreements]
        self._reducer.finish_all()
        self.wait_params()
        return gather_full_state_dict(
            unit.stepper,
            unit.buckets,
            unit.opt.param_groups,
            self.group,
            parked=unit.parked,
            all_gather=self._comm.all_gather_into,
        )

    def load_optimizer_state_dict(
        self, state_dict: dict[str, Any], optimizer: int | ShardedOptimizer | None = None
    ) -> None:
        """Loads a full optimizer state dict (from :meth:`optimizer_state_dict`, a consolidated
        ``ShardedOptimizer`` or a plain torch optimizer) into this rank's shards of a wrapped
        optimizer (``None``: the only one; else its index or itself)."""
        unit = self._unit(optimizer)
        self.wait_params()
        unit.parked = load_full_state_dict(
            unit.stepper, unit.buckets, unit.opt.param_groups, state_dict
        )

    @property
    def comm_stats(self) -> CommStats:
        """Counters of every collective issued since construction (see ``CommStats``)."""
        return self._comm.stats

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of tensors this rank holds by kind: ``params`` (flat buffers), ``grads`` (grad
        shards), ``staging`` (the staging pool, kept between steps by default, which is also
        the local step's scratch: see [Note: Staging lifetime] in ``shardkit.ddp._reducer``),
        ``optimizer`` (state and masters). Live tensors only: what a process keeps resident
        can be more (the allocator's cache, the backend's own buffers)."""
        return {
            "params": sum(b.flat.numel() * b.flat.element_size() for b in self._buckets),
            "grads": sum(
                b.grad_shard.numel() * b.grad_shard.element_size()
                for b in self._buckets
                if b.grad_shard is not None
            ),
            "staging": self._reducer.staging_bytes(),
            "optimizer": sum(u.stepper.state_bytes() + u.parked.nbytes() for u in self._units),
        }
