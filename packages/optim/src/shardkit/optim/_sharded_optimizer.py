"""``ShardedOptimizer``: ZeRO-1 optimizer state sharding around any torch optimizer.

Public entry points for the code that drives the step (shardkit-overlap's comm hook,
shardkit-ddp's ``ShardedDataParallel``); see [Note: Step drivers] in ``shardkit.optim._driver``:

- ``opt.shard_layout`` tells which rank owns which param (a :class:`ShardLayout`);
- ``opt.set_partition(owners, sync_order=...)`` (collective) imposes the owner of every
  param and the layout of the flat sync buffers (one run per DDP bucket and owner);
- ``opt.step_local(params=None, closure=None, **kwargs)`` runs the wrapped optimizer on this
  rank's shard, restricted to ``params`` when given; the cost is O(len(params));
- ``opt.sync_params(params=None, async_op=False)`` broadcasts exactly the owners' values of
  ``params`` (all when ``None``) from the flat buffers; with ``async_op`` it returns the works;
- ``opt.check_step(error=None)`` is the per-step agreement (collective), which a driver runs
  before it changes any shard;
- ``opt.attach_driver(driver)`` / ``opt.detach_driver()`` / ``opt.driver``.

Without a driver, ``step()`` is ``check_step()``, then ``step_local()``, then ``sync_params()``.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._agreement import (
    CONSOLIDATE_CALL,
    IMPLICIT_CONSOLIDATE_CALL,
    REPARTITION_CALL,
    agree_call,
    agree_outcome,
    agree_step,
    agree_values,
    channel,
    check_param_order,
    hyperparam_digest,
    step_flags,
)
from shardkit.optim._args import check_chunk_bytes, check_optim_class, check_timeout
from shardkit.optim._compact import compact_formats
from shardkit.optim._compact_optim import check_compact, compact_class, dequantize_state_dict
from shardkit.optim._consolidate import _consolidate
from shardkit.optim._dist import _resolve_group
from shardkit.optim._driver import (
    ShardLayout,
    ShardOwner,
    StepDriver,
    require_zero1,
    zero1_only,
)
from shardkit.optim._layout import (
    _build_layout,
    _check_algorithm,
    _check_imposed,
    agree_partition_inputs,
)
from shardkit.optim._master import (
    check_master_dtype,
    check_master_remainder,
    master_model_dict,
    no_masters_error,
)
from shardkit.optim._profiling import NO_RANGE, profiler_range
from shardkit.optim._state import (
    _hyperparams,
    _install_state,
    _local_groups,
    _OwnerState,
    _ShardState,
    _StateFlag,
    global_index,
    global_params,
)
from shardkit.optim._state_dict import Consolidations, check_consolidate_args
from shardkit.optim._torch_compat import profiling
from shardkit.optim._zero1 import LocalShards
from shardkit.partition import check_consistent
from torch import nn
from torch.optim import Optimizer

__all__ = ["ShardedOptimizer"]

logger = logging.getLogger("shardkit.optim")
_logged_repartition = False
_logged_implicit = False


class ShardedOptimizer(Optimizer):
    """Shards the state of any ``torch.optim.Optimizer`` over the ranks of a process group (ZeRO-1).

    Each rank keeps the optimizer state of only the params it owns and runs the wrapped
    optimizer (``self.optim``) on them; after the local step every rank receives the updated
    params from their owners with one broadcast per (device, dtype, owner) flat bucket. It is a
    drop-in replacement for ``fairscale.optim.OSS`` (see :class:`OSS` for fairscale's exact
    constructor). All methods documented as collective must be
    called by every rank of ``group``.

    Args:
        params: params or param-group dicts, as for any torch optimizer.
        optim: the torch optimizer class to shard (not an instance).
        group: the process group to shard over (default: the default group).
        broadcast_fp16: send the updated params as fp16 (owners keep their exact values).
        partition_algorithm: ``"greedy"``, ``"sorted_greedy"`` or ``"balanced"``
            (shardkit-partition).
        master_dtype: keep a master copy in this dtype (``torch.float32``) of every owned
            bf16/fp16 param and step it instead of the param, with optimizer state in that
            dtype too (see [Note: Master weights] in ``shardkit.optim._master``). Params
            already in this dtype are stepped as they are (no copy). ``None``: no masters.
        master_grad_bucket_bytes: with masters, the owned grads are upcast and stepped in
            chunks of at most this many bytes of ``master_dtype`` gradients (the extra memory
            of a step); the wrapped optimizer's ``step`` then runs once per chunk, which every
            torch optimizer with per-param state allows. ``None``: one chunk (one ``step``
            call, e.g. for an optimizer that needs all its params at once).
        collective_timeout: seconds (or a ``timedelta``) each collective entry point
            (``step()``, ``consolidate_state_dict()``, the implicit consolidation of
            ``state_dict()``) waits in its agreement for the other ranks before raising that
            some rank did not make the same call (see [Note: Call agreement]); ``None``: 30 s.
            Raise it if ranks legitimately reach ``step()`` far apart (e.g. rank 0 alone runs
            a long evaluation first).
        compact_state: ``"int8"`` or ``"int4"``: keep Adam's / AdamW's moments block-quantized
            (8-bit: about 2.03 bytes per param for both, 4-bit: 1.06; fp32: 8) for every param
            of at least 4096 elements, stepped bit for bit as the plain optimizer whose moments
            are requantized after each step; ZeRO-1, the overlap hook and ZeRO-2 (see [Note:
            Compact state under ZeRO-1] and [Note: Block-aligned fragment buckets]). Needs
            ``optim=torch.optim.Adam`` / ``AdamW`` and fp32 params or
            ``master_dtype=torch.float32``. ``None``: full precision.
        master_remainder: with ``master_dtype=torch.float32``, keep the master of each owned
            bf16 param as the param plus an int16 remainder (2 bytes per param instead of 4):
            bit for bit the masters and updates of plain fp32 masters, params rounded to
            nearest with ties away from zero (see [Note: Remainder masters] in
            ``shardkit.optim._master_set``, [Note: Remainder masters under ZeRO-1]; under
            ShardedDataParallel [Note: Remainder masters under ZeRO-2]). fp16 params keep full fp32 masters.
        compact_compile: with ``compact_state``, step the compact moments with compiled
            kernels (``torch.compile``, inductor), compiled on the first step (seconds, once
            per process). On the CPU the same bytes as the eager step, several times faster
            (see [Note: Compiled step, same bytes] in ``shardkit.optim._compact_fused``); on
            CUDA one kernel per chunk, within a few ulps of the eager step (see [Note: One
            kernel on a GPU] in ``shardkit.optim._compact_kernel``).
            ``False``: the eager step (no compilation). Where compilation fails, the eager step
            runs (logged once on the ``shardkit.optim`` logger). Ignored without
            ``compact_state``.
        **defaults: the wrapped optimizer's arguments (``lr``, ``momentum``, ...).

    Raises:
        TypeError: ``optim`` is not an Optimizer subclass, or ``group`` is not a ProcessGroup.
        ValueError: ranks disagree on the params (fingerprint check), this process is not in
            ``group``, an unknown partition algorithm, ``master_dtype`` with
            ``broadcast_fp16``, a bad ``master_grad_bucket_bytes``, ``compact_state`` with
            large low-precision params and no ``master_dtype``, or ``master_remainder=True``
            without ``master_dtype=torch.float32`` (``TypeError`` if not a bool;
            ``compact_compile`` likewise).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optim: type[Optimizer] = torch.optim.SGD,
        group: dist.ProcessGroup | None = None,
        broadcast_fp16: bool = False,
        *,
        partition_algorithm: str = "sorted_greedy",
        master_dtype: torch.dtype | None = None,
        master_grad_bucket_bytes: int | None = 32 << 20,
        collective_timeout: float | timedelta | None = None,
        compact_state: str | None = None,
        master_remainder: bool = False,
        compact_compile: bool = True,
        **defaults: Any,
    ) -> None:
        optim = check_optim_class(optim, defaults)
        if issubclass(optim, ShardedOptimizer):
            raise TypeError("optim cannot itself be a ShardedOptimizer: pass the inner class")
        if not isinstance(broadcast_fp16, bool):
            raise TypeError(f"broadcast_fp16 must be a bool, got {broadcast_fp16!r}")
        self.master_dtype = check_master_dtype(master_dtype, broadcast_fp16)
        self.master_remainder = check_master_remainder(master_remainder, self.master_dtype)
        self._compact = check_compact(compact_state, optim)
        if not isinstance(compact_compile, bool):
            raise TypeError(
                f"compact_compile must be a bool (compile the compact step or not), got "
                f"{type(compact_compile).__name__}: {compact_compile!r}"
            )
        self._compact_compile = compact_compile
        self._master_grad_bucket_bytes = check_chunk_bytes(master_grad_bucket_bytes)
        self._timeout = check_timeout(collective_timeout)
        self.group: dist.ProcessGroup = _resolve_group(group)
        self.rank: int = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError(
                "this process is not a member of the given group: build the ShardedOptimizer "
                "only on the ranks of its group"
            )
        self.world_size: int = dist.get_world_size(self.group)
        self.global_rank: int = dist.get_rank()
        self.broadcast_fp16 = broadcast_fp16
        self._algorithm = _check_algorithm(partition_algorithm)
        self._optim_cls = optim
        self._optim_defaults = dict(defaults)
        self._initialized = False
        self._state_version = 0
        self._consolidations = Consolidations()  # See [Note: Implicit consolidation].
        self._state_flag = _StateFlag()  # see [Note: State truthiness]
        # See [Note: Imposed partition]: (param ids, requires_grad mask, owners, order).
        self._imposed: tuple[tuple[int, ...], bytes, tuple[int, ...], tuple[int, ...]] | None = None
        self._driver: StepDriver | None = None  # See [Note: Step drivers].
        super().__init__(params, defaults)
        self._layout: ShardLayout
        # This rank's ZeRO-1 shard, built at its first use: see [Note: Nothing built for a
        # hand-over]. ``_owner``: the attached ShardOwner holding the state instead, if any.
        self._local: LocalShards | None = None
        self._carried: dict[int, dict[str, Any]] = {}
        self._owner: ShardOwner | None = None
        self._class_defaults: dict[str, Any] | None = None
        self._rebuild(migrate=False)
        check_param_order(self._layout.params, self.group)  # [Note: Param order fingerprint]
        channel(self.group)  # every rank, here: see [Note: Agreement over the store]
        self._initialized = True

    # ------------------------------------------------------------------ layout
    def _rebuild(self, migrate: bool) -> None:
        """(Re)partitions the params; ZeRO-1's backend is built at first use. Collective."""
        if self._initialized:  # every rank here, within collective_timeout: [Note: Call agreement]
            agree_call(REPARTITION_CALL, self.group, self._timeout)
        params = global_params(self.param_groups)
        self._fill_group_defaults(params)
        mask = bytes(int(p.requires_grad) for p in params)
        agree_partition_inputs(
            params,
            self.param_groups,
            self.group,
            (
                self._algorithm,
                self.broadcast_fp16,
                f"{self.master_dtype}, master_remainder={self.master_remainder}",
                f"{self._optim_cls.__name__}, compact_state={self._compact}",
            ),
        )
        check_consistent(params, group=self.group)
        carried: dict[int, dict[str, Any]] = {}
        if migrate and self._local is not None:  # every param's state (and master) moves
            old = self._local
            owned = old.owned_entries()
            full, _ = _consolidate(owned, self.group, self.rank, -1, set())
            carried = {id(old.layout.params[i]): st for i, st in (full or {}).items()}
            carried.update({id(old.layout.params[i]): dict(st) for i, st in owned.items()})
            old.sync.release(keep=())
        imposed = None
        if self._imposed is not None:
            ids, imposed_mask, owners, order = self._imposed
            if ids == tuple(id(p) for p in params) and imposed_mask == mask:
                imposed = (owners, order)
            else:
                self._imposed = None
        if self._compact is not None and self.master_dtype is None:
            _check_compact_params(params, self._compact)
        self._layout = _build_layout(self.param_groups, self.world_size, self._algorithm, imposed)
        self._local = None
        self._carried = carried
        self.state = _ShardState(dict)
        self.state.flag = self._state_flag
        if carried:
            self._zero1()  # the carried state lands now, while its tensors are live anyway
        self._state_version += 1

    # [Note: Nothing built for a hand-over]
    # ``ShardedOptimizer(...)`` is built before the wrapper that may take its step over
    # (``ShardedDataParallel(model, opt)``: ZeRO-2's engine holds the state then). So the
    # constructor builds only what every mode needs (the partition, the agreements); ZeRO-1's
    # backend (``LocalShards``: the wrapped optimizer, fp32 masters, flat sync buffers) is built
    # at its first use (a step, a state dict, ``optim``, a clip), and never under ZeRO-2: nothing
    # is allocated to be freed at the hand-over. ``self.state`` is the wrapped optimizer's state
    # mapping from the start (empty and falsy until a step or a load: [Note: State truthiness]).
    def _fill_group_defaults(self, params: Sequence[torch.Tensor]) -> None:
        """Gives every param group the optimizer class's defaults it lacks, as the wrapped
        optimizer's constructor would: on every rank alike, built or not ([Note: Nothing built
        for a hand-over]). The class's full defaults come from an instance on a
        stand-in for the first param: its shape, dtype and device in one element of memory (a
        stride-0 view: optimizers that check shapes, like Muon's 2-D rule, see the param's;
        torch optimizers create their state at the first step)."""
        if self._class_defaults is None:
            like = params[0] if params else torch.empty(0)
            dtype = like.dtype if like.is_floating_point() else torch.float32
            probe = torch.zeros((), dtype=dtype, device=like.device).expand(like.shape)
            probe.requires_grad_()
            group = self.optim_class([probe], **self._optim_defaults).param_groups[0]
            self._class_defaults = {k: v for k, v in group.items() if k != "params"}
        for g in self.param_groups:
            for k, v in self._class_defaults.items():
                g.setdefault(k, copy.deepcopy(v))

    def _zero1(self) -> LocalShards:
        """This rank's ZeRO-1 backend, built on first use ([Note: Nothing built for a
        hand-over])."""
        if self._local is None:
            self._local = LocalShards(
                self.param_groups,
                self._layout,
                self._optim_cls,
                self._optim_defaults,
                self.group,
                self.broadcast_fp16,
                self.master_dtype,
                self._master_grad_bucket_bytes,
                self._timeout,
                self._carried,
                self._compact,
                self.master_remainder,
                self._compact_compile,
            )
            self._carried = {}
            if isinstance(self.state, _ShardState):  # no ShardOwner shows its state instead
                local = self._local
                for p, st in self.state.items():  # an owned param's state written before
                    if st and id(p) in local.slot:  # the build (rare): kept
                        local.optim.state.setdefault(local.opt_tensor(p), st)
                self.state = _install_state(local.optim, self._state_flag)
        return self._local

    @property
    def _backend(self) -> ShardOwner:
        """Who holds the state: the attached :class:`ShardOwner`, else ZeRO-1's backend."""
        return self._owner if self._owner is not None else self._zero1()

    @zero1_only("build a new optimizer and wrapper with every param group")
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group; after construction this repartitions (collective)."""
        super().add_param_group(param_group)
        if self._initialized:
            self._rebuild(migrate=True)

    @zero1_only("the wrapper lays out its own buckets")
    def set_partition(
        self, owners: Sequence[int], *, sync_order: Sequence[int] | None = None
    ) -> None:
        """Imposes the owner of every param instead of the partition algorithm's. Collective.

        Existing optimizer state moves to the new owners. The partition stays in force until the
        params or their ``requires_grad`` flags change (see [Note: Imposed partition]).

        Args:
            owners: for each param in global-index order (param groups flattened), the rank of
                the optimizer's group that owns it. Frozen params' entries only say where state
                they carry lives.
            sync_order: global param indices in the order to lay them out in the flat
                broadcast buffers (unlisted params follow in index order); list the params of
                each communication unit (e.g. a DDP gradient bucket) together so that syncing
                one unit is one broadcast per owner.

        Raises:
            TypeError, ValueError: malformed ``owners`` / ``sync_order`` (what was received is
                in the message), or ranks passing different values (raised on every rank).
        """
        agree_call(REPARTITION_CALL, self.group, self._timeout)  # See [Note: Call agreement]
        params = global_params(self.param_groups)
        own, order = _check_imposed(owners, sync_order, params, self.world_size)
        agree_values(
            (
                hashlib.sha1(repr((own, order)).encode()).hexdigest(),
                hyperparam_digest(self.param_groups),
            ),
            self.group,
            "set_partition(owners, sync_order) (hash of the values) and the hyper-parameter digest",
        )
        mask = bytes(int(p.requires_grad) for p in params)
        self._imposed = (tuple(id(p) for p in params), mask, own, order)
        if own == self._layout.owner and order == self._layout.order:
            return
        self._rebuild(migrate=True)

    @zero1_only(
        "call the wrapper's refresh_trainable() (shardkit.ddp.ShardedDataParallel's next "
        "training forward calls it itself with auto_refresh_trainable=True, the default)"
    )
    def refresh_trainable(self) -> None:
        """Repartitions after params were frozen or unfrozen, moving their state. Collective.

        The state of every param is all-gathered once to move it to its new owner: this is meant
        for occasional changes, not every step.
        """
        self._rebuild(migrate=True)

    def partition_parameters(self) -> list[list[dict[str, Any]]]:
        """Per rank, the param groups it steps (fairscale's format)."""
        return [
            [
                {**_hyperparams(g), "params": ps}
                for g, ps in zip(
                    self.param_groups,
                    _local_groups(self._layout, r, len(self.param_groups)),
                    strict=True,
                )
            ]
            for r in range(self.world_size)
        ]

    @property
    def optim(self) -> Optimizer:
        """The wrapped torch optimizer, on this rank's params; absent while a
        :class:`ShardOwner` holds the state (``AttributeError``: [Note: Members of one mode])."""
        # See [Note: Members of one mode] in shardkit.optim._driver
        require_zero1(self, "optim", "optimizer.state shows this rank's shard state")
        return self._zero1().optim

    @property
    def optim_class(self) -> type[Optimizer]:
        """The torch optimizer class that steps this rank's shard (under ``compact_state``, the
        compact subclass of the class passed): what ZeRO-1's :attr:`optim` is an instance of,
        and ZeRO-2's local optimizers too."""
        if self._compact is None:
            return self._optim_cls
        return compact_class(self._optim_cls, self._compact, compiled=self._compact_compile)

    @property
    def compact_state(self) -> str | None:
        """``"int8"`` / ``"int4"`` when the moments are kept block-quantized, else ``None``.

        A step driver that lays out element ranges (shardkit-ddp's ShardedDataParallel)
        passes it to :func:`build_flat_buckets` so that no rank's range cuts a block."""
        return self._compact

    @property
    def shard_layout(self) -> ShardLayout:
        """The current partition: which rank owns which param (read-only)."""
        return self._layout

    @property
    def collective_timeout(self) -> timedelta | None:
        """How long a collective entry point waits for the other ranks (``None``: 30 s); see
        [Note: Call agreement]. Drivers use it for their own agreements."""
        return self._timeout

    @property
    def driver(self) -> StepDriver | None:
        """The attached step driver, if any. See [Note: Step drivers]."""
        return self._driver

    @property
    def param_to_rank(self) -> dict[torch.Tensor, int]:
        """Owner (group rank) of every param."""
        return dict(zip(self._layout.params, self._layout.owner, strict=True))

    @property
    def owned_params(self) -> list[torch.Tensor]:
        """The params whose state this rank holds and which it steps."""
        return [self._layout.params[i] for i in self._layout.owned(self.rank)]

    # ------------------------------------------------------------------ step
    def _check_before_step(self, error: str | None = None, repartition: bool = True) -> None:
        """The per-step agreement (collective): see [Note: Per-step agreement].

        ``error`` is this rank's own reason to refuse the step, raised on every rank.
        """
        changed, error = step_flags(
            self._layout.params, self._layout.trainable, self.rank, error, repartition
        )
        with profiler_range("shardkit.optim.agree") if profiling() else NO_RANGE:
            changed = agree_step(self.param_groups, changed, error, self.group, self._timeout)
        if changed:
            global _logged_repartition
            if not _logged_repartition:
                _logged_repartition = True
                logger.warning(
                    "requires_grad changed on some params since the last partition: "
                    "repartitioning at this step (moves the optimizer state; logged once)"
                )
            warnings.warn(
                "requires_grad changed on some params since the last partition: repartitioning "
                "now (call refresh_trainable() yourself after freezing/unfreezing to avoid this "
                "warning).",
                stacklevel=3,
            )
            self.refresh_trainable()

    def _stepped(self) -> None:
        self._state_version += 1
        self._state_flag.value = True

    @zero1_only("optimizer.step() steps the shards")
    def step_local(
        self,
        params: Iterable[torch.Tensor] | None = None,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Steps this rank's shard only (optionally only ``params``). No communication.

        For step drivers (see [Note: Step drivers]); a training loop calls :meth:`step`.

        With ``params``, costs O(len(params)) besides the step itself: the local groups are
        narrowed to the owned ones among ``params`` for the call, then restored. With master
        weights the step runs chunk by chunk (see [Note: Master weights]).

        Raises:
            RuntimeError: a :class:`ShardOwner` holds the state (it steps it itself).
        """
        loss = self._zero1().step_local(params, closure, **kwargs)
        self._stepped()
        return loss

    @zero1_only("the wrapper all-gathers the params after each step")
    def sync_params(
        self, params: Iterable[torch.Tensor] | None = None, async_op: bool = False
    ) -> list[dist.Work]:
        """Broadcasts owners' values of ``params`` (all if ``None``). Collective.

        See [Note: Exact sync spans] in ``shardkit.optim._sync``: exactly the given params are
        sent, one broadcast per contiguous run of them per owner. With ``async_op`` the works
        are returned unwaited.

        Raises:
            RuntimeError: a :class:`ShardOwner` holds the params (it gathers them itself).
        """
        return self._zero1().sync_params(params, async_op)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Steps this rank's shard, then syncs every param from its owner. Collective.

        With a step driver attached this is ``driver.step(closure, **kwargs)`` (see
        [Note: Step drivers]): e.g. under shardkit-overlap's comm hook, the training loop's
        no-op step after each synchronised backward.

        Args:
            closure: re-evaluates the model and returns the loss (called once on every rank).
            **kwargs: extra arguments forwarded to the wrapped optimizer's ``step``.

        Raises:
            ValueError: ranks disagree on the hyper-parameters (raised on every rank, before
                any shard changes).
            RuntimeError: the attached driver refuses the step (e.g. no synchronised backward
                ran since the last step).
        """
        if self._driver is not None:
            loss = self._driver.step(closure, **kwargs)
            if isinstance(self._driver, ShardOwner):  # See [Note: State truthiness]
                self._stepped()
            else:
                self._state_version += 1
            return loss
        self._check_before_step()  # may repartition: a new backend
        loss = self._zero1().step(closure, **kwargs)
        self._stepped()
        return loss

    # ------------------------------------------------------------------ drivers
    def attach_driver(self, driver: StepDriver) -> None:
        """Hands the step over to ``driver``; see [Note: Step drivers]. Local.

        With a :class:`ShardOwner` the optimizer releases what it allocated for its own step
        (flat sync buffers, the wrapped optimizer's state, master copies) and hands its step,
        gradient, clipping and state-dict calls to the driver for good.

        Raises:
            TypeError: ``driver`` is not a ``StepDriver``.
            RuntimeError: another driver is attached.
        """
        if not isinstance(driver, StepDriver):
            raise TypeError(
                f"driver must be a shardkit.optim.StepDriver, got {type(driver).__name__}: "
                f"{driver!r}; subclass StepDriver (or ShardOwner) and implement its methods"
            )
        if self._driver is not None:
            raise RuntimeError(
                f"this ShardedOptimizer is already driven by {self._driver.name}; an optimizer "
                f"can be driven by one ShardedDataParallel or comm hook at a time. Close that "
                f"one first."
            )
        self._driver = driver
        if isinstance(driver, ShardOwner):
            # The params now live in the driver's buffers: forget ours without touching them
            # (built only if something used it before: [Note: Nothing built for a hand-over]).
            if self._local is not None:
                self._local.release()
                self._local = None
            self._carried = {}
            self._owner = driver
            self._consolidations.drop()
            # See [Note: Optimizer state under ZeRO-2] in shardkit.optim._state
            self.state = _OwnerState(driver, self._state_flag)  # type: ignore[assignment]
        self._state_version += 1

    def detach_driver(self) -> None:
        """Restores the optimizer's own step (a :class:`StepDriver` only). Local.

        Raises:
            RuntimeError: the attached driver is a ``ShardOwner``, which holds the state for
                good: build a new ShardedOptimizer instead.
        """
        if self._owner is not None:
            raise RuntimeError(
                f"{self._owner.name} owns this optimizer's sharded state and cannot be "
                f"detached; build a new ShardedOptimizer to train without it"
            )
        self._driver = None

    def check_step(self, error: str | None = None) -> None:
        """The per-step agreement, for step drivers (collective; see [Note: Per-step agreement]).

        Args:
            error: this rank's own reason to refuse the step (e.g. no synchronised backward
                ran), raised on every rank as a ``RuntimeError``.

        Raises:
            ValueError: ranks disagree on the hyper-parameters (on every rank).
            RuntimeError: some rank passed an ``error``, or requires_grad changed (every rank).
        """
        try:
            self._check_before_step(error, repartition=False)
        except TypeError as e:  # the local reasons are RuntimeErrors
            raise RuntimeError(str(e)) from None

    # ------------------------------------------------------------------ gradients
    def _unscale_for_scaler(
        self, inv_scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor] | None:
        """``ShardedGradScaler``'s unscale: the backend's (``None``: torch's own applies).
        See [Note: Master weights]."""
        return self._backend.unscale_for_scaler(inv_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of every param (owned or not) on this rank.

        With master weights this also drops pending unscale/clip factors (new gradients).
        """
        self._backend.zero_grad(set_to_none)

    def _drop_grad_factors(self) -> None:
        """Forgets pending unscale/clip factors (see [Note: Master weights])."""
        self._backend.drop_grad_factors()

    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        filter_params_fn: Callable[[Any], Any] | None = None,
    ) -> torch.Tensor:
        """Clips gradients by their global norm, like ``torch.nn.utils.clip_grad_norm_``. Collective.

        Each rank reduces its owned params' gradients to fp32 norms of short blocks, combined in
        fp64; one all-gather of one row per rank gives every rank the same total and checks
        that every rank passes the same ``max_norm`` and ``norm_type`` (see [Note: Sharded grad
        norm] in ``shardkit.optim._clip``). Every local gradient is scaled.

        Args:
            max_norm: maximum norm.
            norm_type: p of the p-norm, ``float("inf")`` for the max norm.
            filter_params_fn: maps the list of params to the ones to consider (e.g. to skip
                params already clipped elsewhere); not under ShardedDataParallel, whose
                gradients are sharded by element ranges.

        Returns:
            The total norm before clipping (fp32 scalar tensor).

        Raises:
            TypeError: ``max_norm`` or ``norm_type`` is not a number.
            ValueError: on every rank, when ranks pass different ``(max_norm, norm_type)``
                (naming each rank's values), or invalid ones (negative or NaN ``max_norm``,
                ``norm_type <= 0``).
            RuntimeError: some rank is in another collective call or did not come within
                ``collective_timeout`` (see [Note: Call agreement]).
        """
        return self._backend.clip_grad_norm(max_norm, norm_type, filter_params_fn)

    # ------------------------------------------------------------------ state dicts
    def local_state_dict(self) -> dict[str, Any]:
        """This rank's shard as ``{"state": {global index: state}, "param_groups": ...}`` (live).

        With master weights, also ``"master_params": {global index: master}`` (live). Under a
        ``ShardOwner`` (see [Note: Step drivers]) it is the owner's ``checkpoint_state_dict()``
        (collective there: every rank calls it, as ``save_sharded`` does).
        """
        return self._backend.checkpoint_state_dict()

    def checkpoint_indices(self) -> list[int]:
        """Global indices (see [Note: Global parameter index]) whose saved state this rank
        reads when ``load_sharded`` loads a sharded checkpoint: the params it owns, or under a
        ``ShardOwner`` the indices the owner names (every param, for ZeRO-2's element ranges:
        see [Note: DCP sharded checkpoints]). Local. Part of :class:`ShardedCheckpointable`."""
        return self._backend.checkpoint_indices()

    def consolidate_state_dict(
        self,
        recipient_rank: int = 0,
        skip: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        """Gathers the full state on ``recipient_rank`` (-1: every rank). Collective.

        See [Note: Tensor consolidation] for what moves where. With master weights the master
        values are gathered too (``"master_params"`` in :meth:`state_dict`).

        Args:
            recipient_rank: rank in the optimizer's group, or -1 for all ranks.
            skip: params for which ``skip(param)`` is true keep their state on their owner; the
                consolidated dict has their entries with ``meta`` tensors of the right shapes
                (save those with :meth:`local_state_dict` on each owner instead). Not under
                ShardedDataParallel.

        Raises:
            TypeError, ValueError: a bad argument on any rank (the first failing rank's error,
                raised on every rank).
        """
        # Every rank in this call, within collective_timeout: see [Note: Call agreement].
        agree_call(CONSOLIDATE_CALL, self.group, self._timeout)
        skipped, error = check_consolidate_args(
            recipient_rank, skip, self._layout.params, self.world_size
        )
        # Bad arguments on one rank raise on every rank, before any tensor moves.
        agree_outcome(error, self.group, "consolidate_state_dict", template=_BAD_ARGUMENTS,
                      default=ValueError)  # fmt: skip
        self._consolidations.drop()
        full = self._backend.full_state_dict(recipient_rank, skipped)
        self._consolidations.record(self._state_version, recipient_rank, False, full)

    def _consolidate_implicitly(self) -> None:
        """Consolidates onto every rank. See [Note: Implicit consolidation]. Collective."""
        global _logged_implicit
        if not _logged_implicit:
            _logged_implicit = True
            logger.info(
                "state_dict() with no consolidate_state_dict() since the last step: consolidating "
                "the full optimizer state onto every rank (a collective: every rank calls "
                "state_dict(), as torch.distributed.checkpoint.state_dict does)"
            )
        agree_call(IMPLICIT_CONSOLIDATE_CALL, self.group, self._timeout)  # [Note: Call agreement]
        ShardedOptimizer.consolidate_state_dict(self, recipient_rank=-1)
        self._consolidations.mark_implicit()

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """The consolidated state in plain torch format (loads into ``optim`` unsharded).

        With master weights the dict also has ``"master_params"``: {global index: master
        value} (``master_dtype``, on the CPU), beside the plain ``"state"`` (the state of the
        masters) and ``"param_groups"``; plain torch optimizers ignore the extra key.

        After ``consolidate_state_dict(recipient_rank=r)`` on every rank, call it on rank ``r``
        alone (no communication). In a program that never consolidates explicitly, it is a
        collective that consolidates onto every rank first, so
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` and Accelerate work: see
        [Note: Implicit consolidation].

        Args:
            all_ranks: consolidate on every rank first (collective) and return it everywhere.

        Raises:
            RuntimeError: the state was consolidated onto another rank, or onto this rank and
                the optimizer stepped/loaded since; or, in the implicit collective, some rank
                did not call it within ``collective_timeout``.
        """
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        elif self._consolidations.needs_implicit(self._state_version):
            self._consolidate_implicitly()
        return self._consolidations.current(self._state_version, self.rank)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a plain torch optimizer state dict (from any world size); keeps only this shard.

        The caller's dict is not modified nor aliased. ``meta`` placeholder entries (params
        skipped at consolidation) leave the current state of those params untouched. With
        master weights, each owned master is set from ``"master_params"`` exactly when the dict
        has it, else from the live param (load the model's weights first).
        """
        if self._compact is None and isinstance(state_dict, dict):
            state_dict = dequantize_state_dict(state_dict)  # a format-3 checkpoint's codes
        self._backend.load_full_state_dict(state_dict)
        for wg, sg in zip(self.param_groups, state_dict["param_groups"], strict=True):
            wg.update(copy.deepcopy(_hyperparams(sg)))  # [Note: One owner of hyper-parameters]
        if not isinstance(self.state, _OwnerState):  # [Note: Optimizer state under ZeRO-2]
            self.state = _install_state(self._zero1().optim, self._state_flag)
        self._stepped()

    def master_model_state_dict(
        self, model: nn.Module, recipient_rank: int = 0
    ) -> dict[str, torch.Tensor] | None:
        """The model's state dict at full precision, for export. Collective.

        Every param with a master is replaced by its master value, gathered from its owner;
        every other floating tensor is upcast to ``master_dtype`` (exact); the rest is copied.
        Tensors are on the CPU.

        Args:
            model: the model whose params this optimizer steps (names come from it).
            recipient_rank: rank of the optimizer's group that gets the dict, -1 for every rank.

        Returns:
            The state dict on the recipient(s), ``None`` elsewhere.

        Under a :class:`ShardOwner` (ShardedDataParallel) the masters come with the owner's
        full optimizer state dict (its ``"master_params"``), so the call moves the moments too.

        Raises:
            RuntimeError: the optimizer has no master weights (``master_dtype=None``).
        """
        if self._owner is None:
            return self._zero1().master_model_state_dict(model, recipient_rank)
        if self.master_dtype is None:
            raise no_masters_error("master_model_state_dict")
        full = self._owner.full_state_dict(recipient_rank)
        if full is None:
            return None
        masters = full.get("master_params", {})
        index = global_index(self.param_groups)
        return master_model_dict(model, masters, index, self.master_dtype)

    @zero1_only(
        "load the weights with model.load_state_dict(...) and the exact masters with "
        "optimizer.load_state_dict(sd), whose 'master_params' hold them"
    )
    def load_master_model_state_dict(
        self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Loads full-precision weights into the model (cast to its dtypes) and the masters.

        Every rank passes the whole dict (e.g. from :meth:`master_model_state_dict` or an fp32
        checkpoint): the model's params get the values rounded to their dtype, and the masters
        this rank owns get them exactly. Not a collective.

        Args:
            model: the model whose params this optimizer steps.
            state_dict: the full-precision model state dict.
            strict: as for ``nn.Module.load_state_dict``.

        Raises:
            RuntimeError: the optimizer has no master weights, or a :class:`ShardOwner`
                (ShardedDataParallel) holds them (its message names the calls that load them
                there), or ``strict`` and keys differ.
        """
        self._zero1().load_master_model_state_dict(model, state_dict, strict)
        self._state_version += 1


_BAD_ARGUMENTS = (
    "{what}: rank {rank}{also} of the optimizer's group passed invalid arguments ({kind}: "
    "{message}); fix the call on that rank"
)


def _check_compact_params(params: list[torch.Tensor], kind: str) -> None:
    """Compact moments step an fp32 value: a param laid out for compact moments that would
    step itself in another dtype needs a master ([Note: One compact decider])."""
    low = [
        (i, p.dtype)
        for i, p in enumerate(params)
        if p.requires_grad
        and compact_formats(kind, p.numel(), p.dtype) is not None
        and compact_formats(kind, p.numel(), p.dtype, stepped=p.dtype) is None
    ]
    if low:
        i, dtype = low[0]
        raise ValueError(
            f"compact_state={kind!r} steps fp32 values, but param {i} is {dtype} "
            f"({len(low)} such param(s)) and master_dtype is None: pass "
            f"master_dtype=torch.float32 (fp32 masters, compact moments) or keep fp32 params"
        )
