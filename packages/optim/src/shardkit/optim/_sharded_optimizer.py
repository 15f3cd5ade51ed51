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

import hashlib
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._agreement import (
    CLIP_CALL,
    REPARTITION_CALL,
    agree_call,
    agree_step,
    agree_values,
    check_param_order,
    hyperparam_digest,
)
from shardkit.optim._clip import _clip_grad_norm, check_clip_args
from shardkit.optim._consolidate import _consolidate
from shardkit.optim._dist import _resolve_group
from shardkit.optim._driver import ShardLayout, ShardOwner, StepDriver
from shardkit.optim._exchange import channel
from shardkit.optim._layout import _build_layout, _check_algorithm, _check_imposed
from shardkit.optim._master import (
    _WIRE_KEY,
    _Masters,
    check_master_dtype,
    join_wire,
    needs_master,
    unscale_grads,
)
from shardkit.optim._profiling import profiler_range
from shardkit.optim._state import (
    _hyperparams,
    _install_state,
    _local_groups,
    _owned_state,
    _StateFlag,
)
from shardkit.optim._state_dict import _StateDictMixin
from shardkit.optim._sync import _ParamSync
from shardkit.partition import check_consistent
from torch.optim import Optimizer

__all__ = ["ShardedOptimizer"]

logger = logging.getLogger("shardkit.optim")
_logged_repartition = False


class ShardedOptimizer(_StateDictMixin, Optimizer):
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
        **defaults: the wrapped optimizer's arguments (``lr``, ``momentum``, ...).

    Raises:
        TypeError: ``optim`` is not an Optimizer subclass, or ``group`` is not a ProcessGroup.
        ValueError: ranks disagree on the params (fingerprint check), this process is not in
            ``group``, an unknown partition algorithm, ``master_dtype`` with
            ``broadcast_fp16``, or a bad ``master_grad_bucket_bytes``.
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
        **defaults: Any,
    ) -> None:
        if "optimizer_class" in defaults:
            raise TypeError(
                "ShardedOptimizer takes the optimizer class as optim= (fairscale's keyword); "
                "optimizer_class= is torch ZeroRedundancyOptimizer's. Write "
                "ShardedOptimizer(params, optim=torch.optim.Adam, lr=...), or use "
                "shardkit.optim.ZeroRedundancyOptimizer, which has torch's signature."
            )
        if not (isinstance(optim, type) and issubclass(optim, Optimizer)):
            raise TypeError(
                f"optim must be a torch.optim.Optimizer subclass (the class, e.g. "
                f"torch.optim.Adam), got {type(optim).__name__}: {optim!r}. Pass the class and "
                f"its arguments as keywords: ShardedOptimizer(params, torch.optim.Adam, lr=1e-3)."
            )
        if issubclass(optim, ShardedOptimizer):
            raise TypeError("optim cannot itself be a ShardedOptimizer: pass the inner class")
        if not isinstance(broadcast_fp16, bool):
            raise TypeError(f"broadcast_fp16 must be a bool, got {broadcast_fp16!r}")
        self.master_dtype = check_master_dtype(master_dtype, broadcast_fp16)
        if master_grad_bucket_bytes is not None and (
            isinstance(master_grad_bucket_bytes, bool)
            or not isinstance(master_grad_bucket_bytes, int)
            or master_grad_bucket_bytes <= 0
        ):
            raise ValueError(
                f"master_grad_bucket_bytes must be a positive int (bytes of fp32 gradients "
                f"upcast at a time) or None (all at once), got "
                f"{type(master_grad_bucket_bytes).__name__}: {master_grad_bucket_bytes!r}"
            )
        self._master_grad_bucket_bytes = master_grad_bucket_bytes
        self._timeout = _check_timeout(collective_timeout)
        self._masters: _Masters | None = None
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
        self._consolidated: tuple[int, dict[str, Any]] | None = None
        # (state version, recipient, implicit) of the last consolidation. See
        # [Note: Implicit consolidation] in _state_dict.py.
        self._last_consolidation: tuple[int, int, bool] | None = None
        self._state_flag = _StateFlag()  # see [Note: State truthiness]
        # See [Note: Imposed partition]: (param ids, requires_grad mask, owners, order).
        self._imposed: tuple[tuple[int, ...], bytes, tuple[int, ...], tuple[int, ...]] | None = None
        self._local_slot: dict[int, int] = {}
        self._driver: StepDriver | None = None  # See [Note: Step drivers].
        super().__init__(params, defaults)
        self.optim: Optimizer
        self._layout: ShardLayout
        self._sync: _ParamSync
        self._rebuild(migrate=False)
        check_param_order(self._layout.params, self.group)  # [Note: Param order fingerprint]
        channel(self.group)  # every rank, here: see [Note: Agreement over the store]
        self._initialized = True

    # ------------------------------------------------------------------ layout
    def _rebuild(self, migrate: bool) -> None:
        """(Re)partitions the params and rebuilds the local optimizer and buckets. Collective."""
        if self._initialized:  # every rank here, within collective_timeout: [Note: Call agreement]
            agree_call(REPARTITION_CALL, self.group, self._timeout)
        params = [p for g in self.param_groups for p in g["params"]]
        mask = bytes(int(p.requires_grad) for p in params)
        not_dense = [(i, p.layout) for i, p in enumerate(params) if p.layout != torch.strided]
        agree_values(
            (
                bool(not_dense),
                self._algorithm,
                self.broadcast_fp16,
                str(self.master_dtype),
                hyperparam_digest(self.param_groups),
                self._optim_cls.__name__,
                [len(g["params"]) for g in self.param_groups],
                hashlib.sha1(mask).hexdigest(),
            ),
            self.group,
            "(sparse params, partition_algorithm, broadcast_fp16, master_dtype, hyper-parameter "
            "digest, optim class, param group sizes, requires_grad mask hash)",
        )
        if not_dense:  # every rank agreed on this above, so every rank raises
            i, layout = not_dense[0]
            raise ValueError(
                f"ShardedOptimizer shards dense params only (they become views of flat "
                f"buffers); param {i} has layout {layout} ({len(not_dense)} such param(s)). Keep "
                f"sparse params in a separate, unsharded optimizer."
            )
        check_consistent(params, group=self.group)
        moved: dict[int, dict[str, Any]] = {}
        old_owned: dict[int, dict[str, Any]] = {}
        if migrate:
            old = self._layout
            owned = self._owned_entries()
            full = _consolidate(owned, self.group, self.rank, -1, set())
            moved = {id(old.params[i]): st for i, st in (full or {}).items()}
            old_owned = {id(old.params[i]): dict(st) for i, st in owned.items()}
            self._sync.release(keep=())
        imposed = None
        if self._imposed is not None:
            ids, imposed_mask, owners, order = self._imposed
            if ids == tuple(id(p) for p in params) and imposed_mask == mask:
                imposed = (owners, order)
            else:
                self._imposed = None
        layout = _build_layout(self.param_groups, self.world_size, self._algorithm, imposed)
        local = _local_groups(layout, self.rank, len(self.param_groups))
        self._local_slot = {id(p): gi for gi, ps in enumerate(local) for p in ps}
        if self.master_dtype is not None:  # See [Note: Master weights].
            masters = _Masters(self.master_dtype, self._master_grad_bucket_bytes)
            for ps in local:
                for p in ps:
                    if needs_master(p, self.master_dtype):
                        src = old_owned.get(id(p)) or moved.get(id(p)) or {}
                        value = src.get(_WIRE_KEY)
                        masters.add(p, value if isinstance(value, torch.Tensor) else None)
            self._masters = masters
        opt_local = [[self._opt_tensor(p) for p in ps] for ps in local]
        groups = [
            {**_hyperparams(g), "params": ps}
            for g, ps in zip(self.param_groups, opt_local, strict=True)
        ]
        self.optim = self._optim_cls(groups, **self._optim_defaults)
        self._layout = layout
        if migrate:
            entries: dict[int, dict[str, Any]] = {}
            j = 0
            for ps in local:
                for p in ps:
                    st = {
                        k: v
                        for k, v in (old_owned.get(id(p)) or moved.get(id(p)) or {}).items()
                        if k != _WIRE_KEY
                    }
                    if st:
                        entries[j] = st
                    j += 1
            self.optim.load_state_dict(
                {"state": entries, "param_groups": _index_groups(self.optim.param_groups)}
            )
        # The local optimizer filled in its defaults: make them visible on the wrapper.
        self._pull_hyperparams()
        self.state = _install_state(self.optim, self._state_flag)
        self._sync = _ParamSync(layout, self.group, self.rank, self.broadcast_fp16)
        self._state_version += 1

    def _opt_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the wrapped optimizer steps for ``p`` (its master, or ``p``)."""
        return p if self._masters is None else self._masters.opt_tensor(p)

    def _owned_entries(self) -> dict[int, dict[str, Any]]:
        """This rank's live state by global index, masters riding along (for transport)."""
        local = _owned_state(self.optim.state, self._layout, self.rank, self._opt_tensor)
        if self._masters is None:
            return local
        masters: dict[int, torch.Tensor] = {}
        for i in self._layout.owned(self.rank):
            m = self._masters.get(self._layout.params[i])
            if m is not None:
                masters[i] = m
        return join_wire(local, masters)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group; after construction this repartitions (collective)."""
        self._refuse_repartition("add_param_group")
        super().add_param_group(param_group)
        if self._initialized:
            self._rebuild(migrate=True)

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
        self._refuse_repartition("set_partition")
        agree_call(REPARTITION_CALL, self.group, self._timeout)  # See [Note: Call agreement]
        params = [p for g in self.param_groups for p in g["params"]]
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

    def refresh_trainable(self) -> None:
        """Repartitions after params were frozen or unfrozen, moving their state. Collective.

        The state of every param is all-gathered once to move it to its new owner: this is meant
        for occasional changes, not every step.
        """
        self._refuse_repartition("refresh_trainable")
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
    def _push_hyperparams(self) -> None:
        for wg, lg in zip(self.param_groups, self.optim.param_groups, strict=True):
            for k, v in wg.items():
                if k != "params":
                    lg[k] = v

    def _pull_hyperparams(self) -> None:
        for wg, lg in zip(self.param_groups, self.optim.param_groups, strict=True):
            for k, v in lg.items():
                if k != "params":
                    wg[k] = v

    def _check_before_step(self, error: str | None = None, repartition: bool = True) -> None:
        """The per-step agreement (collective): see [Note: Per-step agreement].

        ``error`` is this rank's own reason to refuse the step, raised on every rank.
        """
        changed = False
        for i, p in enumerate(self._layout.params):
            if (
                error is None
                and p.grad is not None
                and (p.grad.is_sparse or p.grad.layout != torch.strided)
            ):
                error = (
                    f"param {i} (shape {tuple(p.shape)}) has a sparse gradient "
                    f"({p.grad.layout}) on rank {self.rank}; ShardedOptimizer supports dense "
                    f"gradients only. Use nn.Embedding(sparse=False) or keep these params in an "
                    f"unsharded optimizer."
                )
            changed |= repartition and p.requires_grad != self._layout.trainable[i]
        with profiler_range("shardkit.optim.agree"):
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
        """
        self._push_hyperparams()
        try:
            with profiler_range("shardkit.optim.local_step"):  # See [Note: Profiler ranges]
                if self._masters is None:
                    loss = self._step_narrowed(params, closure, **kwargs)
                else:
                    loss = self._step_masters(params, closure, **kwargs)
        finally:
            if self._masters is not None:
                self._masters.factors.clear()
        self._pull_hyperparams()
        self._state_version += 1
        self._state_flag.value = True
        return loss

    def _step_narrowed(
        self,
        params: Iterable[torch.Tensor] | None,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One ``step`` of the wrapped optimizer, its groups narrowed to ``params`` if given."""
        saved: list[list[torch.Tensor]] | None = None
        if params is not None:
            subsets: list[list[torch.Tensor]] = [[] for _ in self.optim.param_groups]
            for p in params:
                gi = self._local_slot.get(id(p))
                if gi is not None:
                    subsets[gi].append(self._opt_tensor(p))
            saved = [g["params"] for g in self.optim.param_groups]
            for g, sub in zip(self.optim.param_groups, subsets, strict=True):
                g["params"] = sub
        try:
            if closure is not None or kwargs:
                return self.optim.step(closure, **kwargs)
            return self.optim.step()
        finally:
            if saved is not None:
                for g, ps in zip(self.optim.param_groups, saved, strict=True):
                    g["params"] = ps

    def _step_masters(
        self,
        params: Iterable[torch.Tensor] | None,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """The local step with master weights, chunk by chunk. See [Note: Master weights]."""
        masters = self._masters
        assert masters is not None  # only called with masters
        loss = None
        if closure is not None:  # evaluated once, before any chunk steps
            with torch.enable_grad():
                loss = closure()
        wanted = None if params is None else {id(p) for p in params}
        owned = [
            p
            for ps in _local_groups(self._layout, self.rank, len(self.param_groups))
            for p in ps
            if wanted is None or id(p) in wanted
        ]
        for chunk in masters.chunks(owned):
            flats = masters.load_grads(chunk)
            self._step_narrowed(chunk.params, None, **kwargs)
            masters.write_back(chunk)
            del flats
        return loss

    def sync_params(
        self, params: Iterable[torch.Tensor] | None = None, async_op: bool = False
    ) -> list[dist.Work]:
        """Broadcasts owners' values of ``params`` (all if ``None``). Collective.

        See [Note: Exact sync spans] in ``shardkit.optim._sync``: exactly the given params are
        sent, one broadcast per contiguous run of them per owner. With ``async_op`` the works
        are returned unwaited.
        """
        with profiler_range("shardkit.optim.sync"):
            return self._sync.sync(params, async_op=async_op)

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
            self._state_version += 1
            return loss
        self._check_before_step()
        self._sync.reattach_moved()  # See [Note: Params moved off their buckets]
        loss = self.step_local(None, closure, **kwargs)
        self.sync_params()
        return loss

    # ------------------------------------------------------------------ drivers
    def attach_driver(self, driver: StepDriver) -> None:
        """Hands the step over to ``driver``; see [Note: Step drivers]. Local.

        With a :class:`ShardOwner` the optimizer releases what it allocated for its own step
        (flat sync buffers, the wrapped optimizer's state, master copies) and forwards its
        step, gradient, clipping and state-dict methods to the driver for good.

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
            # The params now live in the driver's buffers: forget ours without touching them.
            self._sync.drop()
            if self._masters is not None:  # the wrapped optimizer held the masters: unhook
                local = _local_groups(self._layout, self.rank, len(self.param_groups))
                for lg, ps in zip(self.optim.param_groups, local, strict=True):
                    lg["params"] = list(ps)
                self._masters = None
            self.optim.state.clear()
            self._consolidated = None
            self.state = _install_state(self.optim, self._state_flag)
        self._state_version += 1

    def detach_driver(self) -> None:
        """Restores the optimizer's own step (a :class:`StepDriver` only). Local.

        Raises:
            RuntimeError: the attached driver is a ``ShardOwner``, which holds the state for
                good: build a new ShardedOptimizer instead.
        """
        if isinstance(self._driver, ShardOwner):
            raise RuntimeError(
                f"{self._driver.name} owns this optimizer's sharded state and cannot be "
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

    def _owner(self) -> ShardOwner | None:
        return self._driver if isinstance(self._driver, ShardOwner) else None

    def _refuse_repartition(self, what: str) -> None:
        owner = self._owner()
        if owner is not None:
            raise RuntimeError(
                f"{what}: {owner.name} fixed this optimizer's params and bucket layout at "
                f"construction; build a new ShardedOptimizer and wrapper instead"
            )

    def _unscale_for_scaler(
        self, inv_scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor] | None:
        """``ShardedGradScaler``'s unscale with master weights (``None`` without masters).

        Checks every local grad for inf/nan (per device, as torch's GradScaler reports it),
        unscales in place only the grads of params that have no master on any rank (already
        in ``master_dtype``), and queues ``inv_scale`` for the masters' fp32 grads. See
        [Note: Master weights].
        """
        owner = self._owner()
        if owner is not None:
            return owner.unscale_for_scaler(inv_scale)
        masters = self._masters
        if masters is None:
            return None
        found = unscale_grads(
            ((p.grad, masters.covers(p)) for p in self._layout.params if p.grad is not None),
            inv_scale,
        )
        masters.factors.add(inv_scale)
        return found

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of every param (owned or not) on this rank.

        With master weights this also drops pending unscale/clip factors (new gradients).
        """
        owner = self._owner()
        if owner is not None:
            owner.zero_grad(set_to_none)
            return
        super().zero_grad(set_to_none=set_to_none)
        self._drop_grad_factors()

    def _drop_grad_factors(self) -> None:
        """Forgets pending unscale/clip factors (see [Note: Master weights])."""
        owner = self._owner()
        if owner is not None:
            owner.drop_grad_factors()
        elif self._masters is not None:
            self._masters.factors.clear()

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
                params already clipped elsewhere).

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
        owner = self._owner()
        if owner is not None:
            if filter_params_fn is not None:
                raise ValueError(
                    f"clip_grad_norm(filter_params_fn=...) is not supported under {owner.name}: "
                    f"gradients are sharded by element ranges, not params"
                )
            return owner.clip_grad_norm(max_norm, norm_type)
        params = [p for p in self._layout.params if p.requires_grad]
        if filter_params_fn is not None:
            params = list(filter_params_fn(params))
        owned = {id(p) for p in self.owned_params}
        max_f, norm_f = check_clip_args(max_norm, norm_type)  # before the agreement, as ZeRO-2
        with profiler_range("shardkit.optim.clip_grad_norm"):
            # A rank that skips the clip (or is elsewhere) makes every rank raise within
            # collective_timeout, before the norm's all-gather: [Note: Call agreement].
            agree_call(CLIP_CALL, self.group, self._timeout)
            return _clip_grad_norm(
                [p for p in params if id(p) in owned],
                params,
                max_f,
                norm_f,
                self.group,
                self._masters,
            )


def _check_timeout(value: object) -> timedelta | None:
    if value is None or isinstance(value, timedelta):
        if isinstance(value, timedelta) and value.total_seconds() <= 0:
            raise ValueError(f"collective_timeout must be positive, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"collective_timeout must be a positive number of seconds, a timedelta or None, got "
            f"{type(value).__name__}: {value!r}"
        )
    return timedelta(seconds=float(value))


def _index_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    j = 0
    for g in groups:
        n = len(g["params"])
        out.append({**_hyperparams(g), "params": list(range(j, j + n))})
        j += n
    return out
