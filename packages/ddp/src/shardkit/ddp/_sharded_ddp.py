"""``ShardedDataParallel``: ZeRO-2 data parallelism that moves exactly DDP's bytes.

How the wrapped optimizers are driven: [Note: Optimizer hand-over] in
``shardkit.optim._bucket_group``; the options: ``shardkit.ddp._config``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from shardkit.ddp._checks import (
    FORWARD,
    REFRESH,
    agree_plan,
    agree_structure,
    check_params,
    optimizers_of,
)
from shardkit.ddp._config import ShardedDataParallelConfig
from shardkit.ddp._module_copy import drop_deepcopy_plain, make_deepcopy_plain, our_hook
from shardkit.ddp._profiling import NO_RANGE, phase, profiling
from shardkit.optim import (
    BlockFormat,
    CommStats,
    EngineOptions,
    FlatBucket,
    ParamStorageError,
    ShardedOptimizer,
    Zero2Engine,
    agree_call,
    build_flat_buckets,
    global_params,
    is_elementwise,
)
from shardkit.partition import check_consistent
from torch import nn

__all__ = ["ShardedDataParallel"]

logger = logging.getLogger("shardkit.ddp")


class ShardedDataParallel(nn.Module):
    """Data parallelism with sharded gradients and optimizer state (ZeRO-2).

    Gradients are reduce-scattered bucket by bucket during backward into the shard of the rank
    that owns them; ``optimizer.step()`` steps every rank's shard and all-gathers the params.
    Per step each rank sends what DDP's all-reduce sends, holds ``1/N`` of the gradients and of
    the optimizer state (and of the fp32 masters with ``master_dtype``), plus a pool of at most
    two staging buckets (see [Note: Staging lifetime] in ``shardkit.optim._reducer``).
    See [Note: Owner-contiguous buckets] (``shardkit.optim._flat``) for the layout and
    [Note: Optimizer hand-over] (``shardkit.optim._bucket_group``) for how the optimizers are
    driven.

    Gradients and clipping: after a synchronised backward a param's ``.grad`` is a memory-less
    placeholder of its shape and dtype (the reduced gradient lives in the owners' shards), on
    which every torch op raises: ``torch.nn.utils.clip_grad_norm_(module.parameters(), ...)``
    raises a RuntimeError instead of returning 0.0 and clipping nothing. Clip with
    :meth:`clip_grad_norm_` (or ``optimizer.clip_grad_norm``) after backward and before
    ``step()``; it raises after ``step()`` or when called twice. Backwards under
    :meth:`no_sync` leave full local gradients in ``.grad``, as DDP does. See [Note:
    Reduced-grad placeholders] in ``shardkit.optim._placeholders``.

    ``copy.deepcopy`` of the wrapped module gives a plain module (finished params, no hooks,
    no process group), as under DDP; see [Note: Plain deepcopy] in ``shardkit.ddp._module_copy``.

    After training, :meth:`close` (or the end of ``with ShardedDataParallel(...) as ddp:``)
    leaves the module plain; a dropped wrapper is collected with its model. A param whose
    storage was replaced (``p.data = t``, a dtype round trip) is copied back into its bucket by
    the next ``step()``, as DDP keeps training; ``optimizer.state`` shows this rank's shard
    state. See [Note: Closing the wrapper] and shardkit-optim's [Note: Params that left their
    bucket] and [Note: Optimizer state under ZeRO-2].

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
            gathered. See [Note: Deferred param gather] in ``shardkit.optim._gather`` and
            [Note: Param access guard] in ``shardkit.optim._gather``.
        reduce_dtype: the dtype gradients are staged and reduce-scattered in (``None``: each
            bucket's own dtype). ``torch.float16`` / ``torch.bfloat16`` on an fp32 model halve
            the bytes on the wire (like DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``);
            ``torch.float32`` on a bf16 model sums in fp32. The reduced shard is kept in the
            params' dtype. See [Note: Reduce dtype] in ``shardkit.optim._reducer``.
        keep_staging_buffers: ``True`` (default): the (at most two) bucket-sized staging
            buffers are allocated by the first backward and kept from one step to the next,
            so no later step allocates a bucket-sized tensor (the local step borrows them as
            its scratch); they cost two buckets of memory between steps (2 x 25 MiB with the
            default cap), which a CPU process keeps resident either way (glibc does not give
            freed pages back). ``False`` frees them once the step has waited for the last
            reduction, so between steps a rank holds params, grad shards and optimizer state
            only: on CUDA the caching allocator lends those blocks to the next forward's
            activations; every backward allocates them again (on CPU, fresh pages each step).
            See [Note: Staging lifetime] in ``shardkit.optim._reducer``.
        gradient_as_bucket_view: ``True``: in a synchronised backward each param's ``.grad``
            is a zeroed view of its bucket's staging buffer, which ``AccumulateGrad`` adds the
            gradient into, so there is no staging copy (DDP's option of that name). ``False``
            (default): the post-accumulate hook copies the gradient, times ``1/N``, into the
            buffer. Same bits, same memory; the copy moves fewer bytes (one multiply-copy
            against a zero, an add and a scale), so it is the default. See [Note: Gradients as bucket
            views] in ``shardkit.optim._reducer``.
        wire: how gradients travel, and params too unless ``wire_params`` says otherwise.
            ``"exact"`` (default): the bucket's dtype (or ``reduce_dtype``), summed by the
            collective. ``"int8"`` / ``"int4"``: block quantized (a scale per block of 256 /
            64 elements): each bucket's gradients move in one all-to-all and are summed in
            fp32 on their owner in rank order; params move as quantized differences from the
            replica every rank holds, added on every rank alike (replicas stay identical; the
            owner keeps the exact values as masters: fp32 masters of fp32 params, 4/N bytes
            per param). int8 + int8 moves 0.254x the bytes of DDP's fp32 all-reduce, int4 +
            int4 0.141x. A ``shardkit.optim.BlockFormat`` sets the block size or stochastic
            rounding. Does not compose with ``reduce_dtype`` (raises); quantized params need
            ``master_remainder=False``. See [Note: Quantized reduce-scatter] and [Note:
            Weight deltas] in ``shardkit.optim._wire``.
        wire_params: how the param all-gather travels: ``None`` (default) follows ``wire``;
            ``"exact"`` keeps exact params under quantized gradients; ``"int8"`` / ``"int4"``
            / a ``BlockFormat`` quantize the params' deltas alone.
        config: the options above as one :class:`ShardedDataParallelConfig` (then leave the
            keyword arguments at their defaults).

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
        wire: str | BlockFormat = "exact",
        wire_params: str | BlockFormat | None = None,
        config: ShardedDataParallelConfig | None = None,
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
        given = ShardedDataParallelConfig(
            broadcast_buffers=broadcast_buffers,
            sync_models_at_startup=sync_models_at_startup,
            reduce_buffer_size=reduce_buffer_size,
            auto_refresh_trainable=auto_refresh_trainable,
            reduce_fp16=reduce_fp16,
            warn_on_trainable_params_changed=warn_on_trainable_params_changed,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            elementwise=elementwise,
            overlap_param_gather=overlap_param_gather,
            reduce_dtype=reduce_dtype,
            keep_staging_buffers=keep_staging_buffers,
            gradient_as_bucket_view=gradient_as_bucket_view,
            wire=wire,
            wire_params=wire_params,
        )
        if config is not None:
            if not isinstance(config, ShardedDataParallelConfig):
                raise TypeError(
                    f"config must be a ShardedDataParallelConfig, got {type(config).__name__}"
                )
            if given != ShardedDataParallelConfig():
                raise ValueError(
                    "pass the options either as keyword arguments or as config=, not both"
                )
            given = config
        self.ddp_config = given
        """The wrapper's options (see :class:`ShardedDataParallelConfig`)."""
        self.module = module
        self.sharded_optimizers: list[ShardedOptimizer] = opts
        """The wrapped optimizers (fairscale's attribute), in the order given."""
        self.group: dist.ProcessGroup = opts[0].group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        check_params(module, [o.param_groups for o in opts])
        agree_structure(module, opts[0].group)  # before any collective on params/buffers
        params = [p for o in opts for p in global_params(o.param_groups)]
        check_consistent(params, group=self.group)
        self._no_sync = False
        self._closed = False  # See [Note: Closing the wrapper]
        self._module_params = {id(p): weakref.ref(p) for p in module.parameters()}
        """The module's params at construction (a later new object is refused)."""
        self._sync_buffers_next = True  # DDP's require_forward_param_sync
        options = EngineOptions(
            wire_dtype=given.wire_dtype,
            overlap_param_gather=given.overlap_param_gather,
            keep_staging_buffers=given.keep_staging_buffers,
            gradient_as_bucket_view=given.gradient_as_bucket_view,
            grad_wire=given.grad_wire,
            param_wire=given.param_wire,
        )
        self._engine = Zero2Engine(opts, options)
        """The ZeRO-2 engine this module adapter drives (see shardkit-optim's [Note: One
        engine, one adapter])."""
        self._build(self.ddp_config.sync_models_at_startup)
        devices = {p.device for p in params}
        self.is_multi_device_module = len(devices) > 1
        self.device_type = next(iter(devices)).type if devices else "cpu"
        self._handles: list[Any] = []
        pre_forward = our_hook(self._pre_forward)  # one object per hook: [Note: Plain deepcopy]
        before_state_dict = our_hook(self._before_state_dict)
        for sub in module.modules():
            if sub is module or next(sub.parameters(recurse=False), None) is not None:
                # See [Note: Deferred param gather] in shardkit.optim._gather: every module that
                # holds params waits before its forward, its state_dict() and load_state_dict()
                hooked = cast(Any, sub)
                self._handles += [
                    hooked.register_forward_pre_hook(pre_forward),
                    hooked.register_state_dict_pre_hook(before_state_dict),
                    hooked.register_load_state_dict_pre_hook(before_state_dict),
                ]
                make_deepcopy_plain(sub, self.wait_params)  # See [Note: Plain deepcopy]
        self._engine.attach()  # See [Note: Optimizer hand-over]
        self._engine.stats.reset()

    def _build(self, sync: bool) -> None:
        """Plans the buckets of the trainable params, re-points them into the flat buffers, and
        builds (or, on :meth:`refresh_trainable`, rebuilds) the bucket groups and the backward
        pass's layout and hooks. Collective (the plan agreement, the startup broadcast)."""
        config = self.ddp_config
        opts = self.sharded_optimizers
        per_opt: list[list[FlatBucket]] = []
        prints: list[str] = [
            f"reduce_dtype={config.wire_dtype}",
            f"wire={config.grad_wire}, wire_params={config.param_wire}",
        ]
        first = 0
        for k, o in enumerate(opts):
            flags = [is_elementwise(o.optim_class, config.elementwise)] * len(o.param_groups)
            mine, group_prints = build_flat_buckets(
                o.param_groups, flags, self.world_size, config.cap_bytes, config.first_cap_bytes,
                first_index=first, bucket_type=FlatBucket, compact_state=o.compact_state,
            )  # fmt: skip
            per_opt.append(mine)
            first += len(mine)
            prints += [f"optimizer {k}: {fp}" for fp in group_prints]
        agree_plan(prints, self.group)
        if sync:
            self._sync_at_startup(
                [b for bs in per_opt for b in bs],
                [p for o in opts for p in global_params(o.param_groups)],
            )
        self._engine.lay_out(per_opt, self.module)

    @property
    def _buckets(self) -> list[FlatBucket]:
        """Every bucket of every group, in launch order."""
        return self._engine.buckets

    # ------------------------------------------------------------------ options
    @property
    def broadcast_buffers(self) -> bool:
        """See :attr:`ShardedDataParallelConfig.broadcast_buffers`."""
        return self.ddp_config.broadcast_buffers

    @property
    def auto_refresh_trainable(self) -> bool:
        """See :attr:`ShardedDataParallelConfig.auto_refresh_trainable`."""
        return self.ddp_config.auto_refresh_trainable

    @property
    def warn_on_trainable_params_changed(self) -> bool:
        """See :attr:`ShardedDataParallelConfig.warn_on_trainable_params_changed`."""
        return self.ddp_config.warn_on_trainable_params_changed

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (``reduce_fp16`` resolved); ``None``: each
        bucket's own. See [Note: Reduce dtype] in ``shardkit.optim._reducer``."""
        return self.ddp_config.wire_dtype

    @property
    def overlap_param_gather(self) -> bool:
        """See :attr:`ShardedDataParallelConfig.overlap_param_gather`."""
        return self.ddp_config.overlap_param_gather

    @property
    def gradient_as_bucket_view(self) -> bool:
        """See [Note: Gradients as bucket views] in ``shardkit.optim._reducer``."""
        return self.ddp_config.gradient_as_bucket_view

    @property
    def last_closure_loss(self) -> Any:
        """The loss of the last closure a wrapped optimizer's ``step(closure)`` ran (fairscale's
        attribute); ``None`` before any."""
        return self._engine.last_closure_loss

    # ------------------------------------------------------------------ set-up
    def _sync_at_startup(self, buckets: list[FlatBucket], params: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for b in buckets:
                self._engine.broadcast(b.flat, 0)
            bucketed = {id(p) for b in buckets for p in b.params}
            for p in params:
                if id(p) not in bucketed:
                    self._engine.broadcast(p.data, 0)
            for buf in self.module.buffers():
                self._engine.broadcast(buf, 0)

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
        if self._closed:
            raise RuntimeError(
                "ShardedDataParallel.forward(): this wrapper was closed (close() or the end of "
                "its with block); call the module itself (ddp.module) for inference, or build "
                "a new ShardedOptimizer and ShardedDataParallel to train again"
            )
        if self.training and torch.is_grad_enabled():
            self._engine.refuse_graph_grads()
            if self._engine.trainable_changed(self.module.parameters()):
                self._refuse_new_params()
                if self.auto_refresh_trainable:
                    self.refresh_trainable()  # See [Note: Trainable refresh]
        self._engine.forward_started()  # forgets a backward that raised before its end
        buffers = list(self.module.buffers()) if self.broadcast_buffers else []
        if buffers and self._sync_buffers_next:
            self._agree(FORWARD)  # See [Note: Wrapper agreements]
            with torch.no_grad(), phase("broadcast_buffers") if profiling() else NO_RANGE:
                for buf in buffers:
                    self._engine.broadcast(buf, 0)
        out = self.module(*args, **kwargs)
        self._sync_buffers_next = torch.is_grad_enabled() and not self._no_sync
        return out

    def _refuse_new_params(self) -> None:
        """Raises if the module holds a ``Parameter`` it did not hold when wrapped (shardkit-optim's
        [Note: Params that left their bucket]: a new object is refused, not re-linked)."""
        known = self._module_params
        new = [
            name
            for name, p in self.module.named_parameters()
            if (ref := known.get(id(p))) is None or ref() is not p
        ]
        if new:
            raise ParamStorageError(
                f"the module holds new Parameter objects that the wrapped optimizer does not "
                f"know: {new[:5]} (load_state_dict(assign=True), or an attribute assigned a new "
                f"nn.Parameter, after ShardedDataParallel was built); they would not be trained "
                f"(under DDP neither). Load values in place (load_state_dict() without "
                f"assign=True, or p.data = t / p.copy_(t): those are re-linked), or build a new "
                f"ShardedOptimizer and ShardedDataParallel around the module"
            )

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
        if not self._agree(REFRESH, digest=digest):
            raise ValueError(
                "ShardedDataParallel.refresh_trainable(): ranks changed requires_grad on "
                "different params; every rank must freeze and unfreeze the same params"
            )
        if self._engine.has_reduced_grads():  # agreed: launches are collective
            raise RuntimeError(
                "requires_grad changed while reduced gradients wait for optimizer.step(): call "
                "step() or zero_grad() before changing which params train"
            )
        check_params(self.module, [o.param_groups for o in self.sharded_optimizers])
        # each optimizer_state_dict() waits for the reductions and the param gathers first
        states = [self._engine.full_state_dict(k) for k in range(len(self.sharded_optimizers))]
        with torch.no_grad():
            for b in self._buckets:
                for p in b.params:
                    p.data = p.data.clone()  # off the old flat buffer
        self._build(sync=False)
        for k, sd in enumerate(states):
            self._engine.load_full_state_dict(k, sd)
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
        self._engine.enter_no_sync()  # counted, agreed at the next reduction
        try:
            yield
        finally:
            self._no_sync = old
            self._engine.set_sync(not old)

    def reduce(self) -> None:
        """Reduces the gradients accumulated in ``.grad`` (under ``no_sync()``) now, outside a
        backward pass (fairscale's manual reduction). Collective."""
        if self._engine.in_backward:
            raise RuntimeError("ShardedDataParallel.reduce() cannot run inside a backward pass")
        self._engine.reduce()

    # ------------------------------------------------------------------ agreement
    def _agree(self, call: str, digest: int = 0) -> bool:
        """Whether every rank of the optimizers' group entered ``call`` with the same ``digest``
        (bounded by ``collective_timeout``). See [Note: Wrapper agreements] in
        ``shardkit.ddp._checks``."""
        opt = self.sharded_optimizers[0]
        same, _, _ = agree_call(call, opt.group, opt.collective_timeout, digest=digest)
        return bool(same)

    def wait_params(self) -> None:
        """Waits for every param all-gather still in flight.

        Torch functions on the training thread wait by themselves ([Note: Param access guard]
        in ``shardkit.optim._gather``); call this before params are read where no torch function
        is seen: from another thread, through a raw pointer or a C++ extension.
        """
        self._engine.wait_params()

    # [Note: Closing the wrapper]
    # The wrapper's hold on the user's module and the torch-function mode stack ends at
    # ``close()`` (or the end of a ``with`` block), or when the wrapper and its optimizers are
    # collected (shardkit-optim's [Note: The window belongs to the wrapper]). ``close()`` waits
    # for the pending param gathers (the guard leaves the stack), removes every hook the
    # wrapper put on the module and its params and the ``.grad`` placeholders, and leaves the
    # module a plain module holding the trained params (still views of the flat buffers, which
    # the module keeps alive). It never touches the user's process group. After it the
    # wrapper's forward and its optimizers' ``step()`` raise.
    def close(self) -> None:
        """Ends the wrapper's hold on the module: waits for the param gathers in flight,
        removes its hooks and ``.grad`` placeholders. Local; idempotent; the process group is
        the user's and stays. See [Note: Closing the wrapper].

        Raises:
            RuntimeError: called inside a backward pass.
        """
        if self._closed:
            return
        self._engine.close()
        for h in self._handles:
            h.remove()
        self._handles = []
        for sub in self.module.modules():
            drop_deepcopy_plain(sub)
        self._closed = True

    def __enter__(self) -> ShardedDataParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._engine.before_forward(module)

    def _before_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.wait_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops every gradient: reduced shards and ``.grad`` left by ``no_sync()``."""
        self._engine.zero_grad(self.module.parameters(), set_to_none)

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
                either. See [Note: Clip agreement] in ``shardkit.optim._reducer``.
        """
        return self._engine.clip_grad_norm(max_norm, norm_type)

    # ------------------------------------------------------------------ state
    def _index_of(self, optimizer: int | ShardedOptimizer | None) -> int:
        opts = self.sharded_optimizers
        if optimizer is None:
            if len(opts) != 1:
                raise ValueError(
                    f"this ShardedDataParallel wraps {len(opts)} optimizers: name one "
                    f"(optimizer=k or the optimizer itself)"
                )
            return 0
        for k, o in enumerate(opts):
            if optimizer is o or (
                isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer == k
            ):
                return k
        raise ValueError(
            f"optimizer must be None, an index below {len(opts)} or one of the wrapped "
            f"optimizers, got {optimizer!r}"
        )

    def optimizer_state_dict(
        self, optimizer: int | ShardedOptimizer | None = None
    ) -> dict[str, Any]:
        """The full state dict of a wrapped optimizer (``None``: the only one; else its index
        or itself) in plain torch format, on every rank. Collective.

        See [Note: Optimizer state format] in ``shardkit.optim._shard_state``.
        """
        return self._engine.full_state_dict(self._index_of(optimizer))

    def load_optimizer_state_dict(
        self, state_dict: dict[str, Any], optimizer: int | ShardedOptimizer | None = None
    ) -> None:
        """Loads a full optimizer state dict (from :meth:`optimizer_state_dict`, a consolidated
        ``ShardedOptimizer`` or a plain torch optimizer) into this rank's shards of a wrapped
        optimizer (``None``: the only one; else its index or itself)."""
        self._engine.load_full_state_dict(self._index_of(optimizer), state_dict)

    @property
    def comm_stats(self) -> CommStats:
        """Counters of every collective issued since construction (see ``CommStats``)."""
        return self._engine.stats

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of tensors this rank holds by kind: ``params`` (flat buffers), ``grads`` (grad
        shards), ``staging`` (the staging pool, kept between steps by default, which is also
        the local step's scratch: see [Note: Staging lifetime] in ``shardkit.optim._reducer``),
        ``optimizer`` (state and masters). Live tensors only: what a process keeps resident
        can be more (the allocator's cache, the backend's own buffers)."""
        return dict(self._engine.memory_bytes())
