"""ZeRO-1's backend: the wrapped optimizer on the whole params this rank owns, and their sync.

``LocalShards`` is the :class:`ShardOwner` a ``ShardedOptimizer`` builds for itself (see
[Note: Step drivers] in ``shardkit.optim._driver``): it holds this rank's optimizer state, the
master copies of its params, the flat buffers the owners broadcast from, and runs the local
step. The front (``ShardedOptimizer``) owns the partition, the agreements and the
hyper-parameters ([Note: One owner of hyper-parameters]); it builds a new ``LocalShards``
whenever the partition changes, and hands its calls to ShardedDataParallel's bucket groups
instead once one is attached. Its masters are a :class:`~shardkit.optim._master_set.MasterSet`
of whole params (one stepped tensor per owned param that needs a master), stepped chunk by
chunk ([Note: Master weights]).

[Note: Remainder masters under ZeRO-1]
With ``ShardedOptimizer(..., master_dtype=torch.float32, master_remainder=True)`` each owned
bf16 param keeps its exact fp32 master as itself plus an int16 remainder (one tensor per param,
as fp32 masters are), stepped through a handle ([Note: Remainder masters] in
``_master_set.py``). The step's scratch is the masters' own (:meth:`MasterSet.kept`: one buffer
of upcast gradients and one of joined masters per device, each the size of the largest chunk's,
reused): chunks count a remainder param's gradient and joined master together
(:meth:`MasterSet.cost`), so for a bf16 model the two buffers hold ``master_grad_bucket_bytes``
together, as fp32 masters' gradients alone would (up to 1.5 times that when fp16 params with
full masters fill other chunks); with ``master_grad_bucket_bytes=None`` (one chunk) the scratch
is as large as all of them, and the saving is gone at the step's peak. A param another rank
owns is written as the owner's split writes it when a master is loaded (:meth:`MasterSet.mirror`),
so the replicas agree before the next sync.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._agreement import CLIP_CALL, MASTER_STATE_DICT_CALL, agree_call
from shardkit.optim._clip import _clip_grad_norm, check_clip_args
from shardkit.optim._compact_optim import compact_class
from shardkit.optim._consolidate import _consolidate
from shardkit.optim._driver import ShardLayout, ShardOwner
from shardkit.optim._full_state import (
    Holdings,
    gather_state_dict,
    plain_dict,
    saved_state,
    transport_state,
)
from shardkit.optim._master import (
    _WIRE_KEY,
    join_wire,
    master_model_dict,
    needs_master,
    no_masters_error,
    split_wire,
    unscale_grads,
)
from shardkit.optim._master_set import (
    GradFactors,
    MasterSet,
    ShardPart,
    Stepped,
    pack,
    step_shard,
)
from shardkit.optim._profiling import profiler_range
from shardkit.optim._state import (
    _hyperparams,
    _local_groups,
    _local_load_dict,
    _owned_state,
    numbered_groups,
    share_hyperparams,
)
from shardkit.optim._sync import _ParamSync
from torch import nn
from torch.optim import Optimizer

__all__ = ["LocalShards"]

logger = logging.getLogger("shardkit.optim")
_warned_ignored_masters = False


class LocalShards(ShardOwner):
    """This rank's ZeRO-1 shard: whole params, stepped by a wrapped torch optimizer.

    Args:
        param_groups: The front's param groups (their hyper-parameters are shared, not copied).
        layout: The partition (which rank owns which param).
        optim_cls: The torch optimizer class to run on the owned params.
        defaults: Its keyword arguments.
        group: The optimizer's process group.
        broadcast_fp16: Send fp32 params as fp16 in the sync.
        master_dtype: Dtype of the master copies of lower-precision params, or ``None``.
        master_grad_bucket_bytes: Bytes of upcast gradients per chunk of the masters' step.
        timeout: The front's ``collective_timeout`` (for the clip's call agreement).
        carried: State (and masters, under the wire key) carried over from the previous
            partition, by ``id(param)``.
        compact_state: ``"int8"`` / ``"int4"``: Adam's moments kept block-quantized (see
            [Note: Compact state under ZeRO-1]), or ``None``.
        master_remainder: bf16 params' masters kept as int16 remainders (see [Note: Remainder
            masters under ZeRO-1]); needs ``master_dtype=torch.float32``.
        compact_compile: Step compact moments with the compiled kernels (see [Note: Compiled
            step, same bytes] in ``_compact_fused.py``; on CUDA [Note: One kernel on a GPU] in
            ``_compact_kernel.py``).
    """

    name = "ShardedOptimizer"

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        layout: ShardLayout,
        optim_cls: type[Optimizer],
        defaults: dict[str, Any],
        group: dist.ProcessGroup,
        broadcast_fp16: bool,
        master_dtype: torch.dtype | None,
        master_grad_bucket_bytes: int | None,
        timeout: timedelta | None,
        carried: Mapping[int, Mapping[str, Any]],
        compact_state: str | None = None,
        master_remainder: bool = False,
        compact_compile: bool = True,
    ) -> None:
        self.param_groups = param_groups
        self.layout = layout
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout = timeout
        local = _local_groups(layout, self.rank, len(param_groups))
        self.owned_groups = local
        """The owned params of each group (one list per group, maybe empty)."""
        self.slot = {id(p): gi for gi, ps in enumerate(local) for p in ps}
        """``id(param) -> index of its group`` for the owned params."""
        self.masters: MasterSet | None = None
        """The masters of the owned params (one stepped tensor each: the whole param)."""
        self.chunk_bytes = master_grad_bucket_bytes
        """Bytes of scratch per chunk of the masters' step (``None``: one chunk)."""
        if master_dtype is not None:  # See [Note: Master weights].
            self.masters = MasterSet(master_dtype, master_remainder)
            items: list[Stepped] = []
            values: list[torch.Tensor | None] = []
            for p in (p for ps in local for p in ps if needs_master(p, master_dtype)):
                value = carried.get(id(p), {}).get(_WIRE_KEY)
                items.append(Stepped(p, p))
                values.append(value if isinstance(value, torch.Tensor) else None)
            self.masters.attach(items, values)
        groups = [
            {**_hyperparams(g), "params": [self.opt_tensor(p) for p in ps]}
            for g, ps in zip(param_groups, local, strict=True)
        ]
        if compact_state is not None:
            optim_cls = compact_class(optim_cls, compact_state, compiled=compact_compile)
        self.optim: Optimizer = optim_cls(groups, **defaults)
        """The wrapped optimizer, on this rank's params (or their masters)."""
        entries: dict[int, dict[str, Any]] = {}
        for j, p in enumerate(p for ps in local for p in ps):
            st = {k: v for k, v in carried.get(id(p), {}).items() if k != _WIRE_KEY}
            if st:
                entries[j] = st
        if entries:
            self.optim.load_state_dict({"state": entries, "param_groups": numbered_groups(groups)})
        share_hyperparams(param_groups, self.optim)  # [Note: One owner of hyper-parameters]
        self.sync = _ParamSync(layout, group, self.rank, broadcast_fp16)

    def opt_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the wrapped optimizer steps for ``p`` (its master, or ``p``)."""
        return p if self.masters is None else self.masters.opt_tensor(p)

    def owned_entries(self, compact: bool = False) -> dict[int, dict[str, Any]]:
        """This rank's live state by global index, masters riding along (for transport).

        Compact moments travel as fp32 ([Note: Compact state under ZeRO-1]), or as they are
        with ``compact`` (a checkpoint's items: [Note: Compact checkpoint items])."""
        local = {
            i: transport_state(st, compact)
            for i, st in _owned_state(
                self.optim.state, self.layout, self.rank, self.opt_tensor
            ).items()
        }
        if self.masters is None:
            return local
        masters: dict[int, torch.Tensor] = {}
        for i in self.layout.owned(self.rank):
            m = self.masters.value(self.layout.params[i])
            if m is not None:
                masters[i] = m
        return join_wire(local, masters)

    def release(self) -> None:
        """Frees what this backend allocated without touching the params (a ``ShardOwner``
        took them over: see [Note: Step drivers])."""
        self.sync.drop()
        if self.masters is not None:  # the wrapped optimizer held the masters: unhook
            for lg, ps in zip(self.optim.param_groups, self.owned_groups, strict=True):
                lg["params"] = list(ps)
            self.masters = None
        self.optim.state.clear()

    # ------------------------------------------------------------------ step
    def step(self, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        """The local step, then the sync; the front ran the per-step agreement already (it may
        repartition there, which only the front can do)."""
        self.sync.reattach_moved()  # See [Note: Params moved off their buckets]
        loss = self.step_local(None, closure, **kwargs)
        self.sync_params()
        return loss

    def step_local(
        self,
        params: Iterable[torch.Tensor] | None = None,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Steps this rank's shard only (optionally only ``params``); see
        ``ShardedOptimizer.step_local``."""
        with profiler_range("shardkit.optim.local_step"):  # See [Note: Profiler ranges]
            masters = self.masters
            if masters is None:  # one plain part: the wrapped optimizer's own step
                result: list[Any] = []

                def run() -> None:
                    result.append(self._step_narrowed(params, closure, **kwargs))

                step_shard(None, GradFactors(), (), [ShardPart(run)], None)
                return result[0]
            try:  # evaluated once, before any part steps
                loss = None
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
            except BaseException:
                masters.factors.clear()
                raise
            wanted = None if params is None else {id(p) for p in params}
            owned = [p for ps in self.owned_groups for p in ps if wanted is None or id(p) in wanted]
            stepped = [s for p in owned if (s := masters.get(p)) is not None]
            parts = self._master_parts(masters, owned, **kwargs)
            step_shard(masters, masters.factors, stepped, parts, masters.kept)
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
                gi = self.slot.get(id(p))
                if gi is not None:
                    subsets[gi].append(self.opt_tensor(p))
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

    def _master_parts(
        self, masters: MasterSet, owned: list[torch.Tensor], **kwargs: Any
    ) -> Iterator[ShardPart]:
        """ZeRO-1's parts of [Note: One shard step]: the owned params in order, packed by
        ``master_grad_bucket_bytes`` of upcast gradients; each part steps the wrapped
        optimizer narrowed to its params (their masters, or themselves)."""

        def cost(p: torch.Tensor) -> int:  # what a param adds to its part's scratch
            s = masters.get(p)
            return 0 if s is None or p.grad is None else masters.cost(s)

        for chunk in pack(owned, cost, self.chunk_bytes):
            part = [s for p in chunk if (s := masters.get(p)) is not None and p.grad is not None]
            run = functools.partial(self._step_narrowed, chunk, None, **kwargs)
            yield ShardPart(run, part, [_grad(s.param) for s in part])

    def sync_params(
        self, params: Iterable[torch.Tensor] | None = None, async_op: bool = False
    ) -> list[dist.Work]:
        """Broadcasts owners' values of ``params`` (all if ``None``). Collective."""
        with profiler_range("shardkit.optim.sync"):
            return self.sync.sync(params, async_op=async_op)

    # ------------------------------------------------------------------ ShardOwner: grads
    def zero_grad(self, set_to_none: bool) -> None:
        """Clears the gradients of every param (owned or not) and the pending factors."""
        for p in self.layout.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()
        self.drop_grad_factors()

    def drop_grad_factors(self) -> None:
        if self.masters is not None:
            self.masters.factors.clear()

    def unscale_for_scaler(
        self, inv_scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor] | None:
        """With masters: checks every local grad for inf/nan (per device), unscales in place
        only the grads of params without a master on any rank and queues ``inv_scale`` for
        the masters' fp32 grads ([Note: Master weights]). Without masters: ``None`` (torch's
        own unscale applies)."""
        masters = self.masters
        if masters is None:
            return None
        found = unscale_grads(
            ((p.grad, masters.covers(p)) for p in self.layout.params if p.grad is not None),
            inv_scale,
        )
        masters.factors.add(inv_scale)
        return found

    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float,
        filter_params_fn: Callable[[Any], Any] | None = None,
    ) -> torch.Tensor:
        """See ``ShardedOptimizer.clip_grad_norm``."""
        params = [p for p in self.layout.params if p.requires_grad]
        if filter_params_fn is not None:
            params = list(filter_params_fn(params))
        max_f, norm_f = check_clip_args(max_norm, norm_type)  # before the agreement, as ZeRO-2
        owned = {id(self.layout.params[i]) for i in self.layout.owned(self.rank)}
        with profiler_range("shardkit.optim.clip_grad_norm"):
            # A rank that skips the clip (or is elsewhere) makes every rank raise within
            # collective_timeout, before the norm's all-gather: [Note: Call agreement].
            agree_call(CLIP_CALL, self.group, self.timeout)
            return _clip_grad_norm(
                [p for p in params if id(p) in owned],
                params,
                max_f,
                norm_f,
                self.group,
                self.masters,
            )

    # ------------------------------------------------------------------ ShardOwner: state
    def full_state_dict(
        self, recipient_rank: int = -1, skip: Set[int] = frozenset()
    ) -> dict[str, Any] | None:
        """The full state onto ``recipient_rank`` (-1: every rank); ``None`` elsewhere.
        Collective. See [Note: Tensor consolidation]."""
        owned = set(self.layout.owned(self.rank))
        with profiler_range("shardkit.optim.consolidate"):  # See [Note: Profiler ranges]
            return gather_state_dict(  # See [Note: One full state dict]
                Holdings(self.owned_entries()),
                self.param_groups,
                self.group,
                recipient_rank,
                with_masters=self.masters is not None,
                skipped=set(skip) & owned,
            )

    def checkpoint_state_dict(self) -> dict[str, Any]:
        """This rank's shard as ``{"state": {global index: state}, "param_groups": ...}``
        (live; compact moments as ``CompactTensor``), with ``"master_params"`` when there are
        masters. Local."""
        state, masters = split_wire(self.owned_entries(compact=True))
        return plain_dict(state, masters, self.param_groups, self.masters is not None)

    def checkpoint_indices(self) -> list[int]:
        return self.layout.owned(self.rank)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keeps this rank's part of a plain torch state dict (any world size). Local.

        ``meta`` entries (skipped at consolidation) keep the current state; each owned master
        is set from ``"master_params"`` when the dict has it, else from the live param.
        """
        global _warned_ignored_masters
        # validated once, as ZeRO-2's loader does: see [Note: One full state dict]
        masters_in = saved_state(state_dict, self.param_groups).masters
        params = list(self.layout.params)
        if self.masters is None and masters_in and not _warned_ignored_masters:
            _warned_ignored_masters = True
            logger.warning(
                "load_state_dict: the state dict carries %d master weights "
                "('master_params') but this optimizer has master_dtype=None; they are "
                "ignored (build the optimizer with master_dtype=torch.float32 to keep them)",
                len(masters_in),
            )
        current = {
            p: st
            for p in (params[i] for i in self.layout.owned(self.rank))
            if (st := self.optim.state.get(self.opt_tensor(p)))
        }
        local = _local_load_dict(
            state_dict, self.layout, self.rank, len(self.param_groups), current
        )
        self.optim.load_state_dict(local)
        share_hyperparams(self.param_groups, self.optim)  # load replaced the views
        if self.masters is not None:
            with torch.no_grad():
                owned = set(self.layout.owned(self.rank))
                for i in owned:
                    value = masters_in.get(i)
                    if not self.masters.has(params[i]) or (value is not None and value.is_meta):
                        continue  # no master, or skipped at consolidation: keep it
                    self.masters.set(params[i], value)
                for i, value in masters_in.items():
                    if i not in owned and not value.is_meta:
                        self.masters.mirror(params[i], value)
            self.masters.mark_current(params[i] for i in self.layout.owned(self.rank))

    # ------------------------------------------------------------------ masters
    def master_model_state_dict(
        self, model: nn.Module, recipient_rank: int
    ) -> dict[str, torch.Tensor] | None:
        """See ``ShardedOptimizer.master_model_state_dict``. Collective."""
        masters = self._require_masters("master_model_state_dict")
        agree_call(MASTER_STATE_DICT_CALL, self.group, self.timeout)  # [Note: Call agreement]
        index = self.layout.index_of()
        local: dict[int, dict[str, Any]] = {}
        for i in self.layout.owned(self.rank):
            m = masters.value(self.layout.params[i])
            if m is not None:
                local[i] = {"master": m}
        full, _ = _consolidate(local, self.group, self.rank, recipient_rank, set())
        if full is None:
            return None
        by_index = {gi: st["master"] for gi, st in full.items()}
        return master_model_dict(model, by_index, index, masters.dtype)

    def load_master_model_state_dict(
        self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool
    ) -> None:
        """See ``ShardedOptimizer.load_master_model_state_dict``. Local."""
        masters = self._require_masters("load_master_model_state_dict")
        model.load_state_dict(state_dict, strict=strict)
        values = dict(state_dict)
        index = self.layout.index_of()
        with torch.no_grad():
            for name, p in model.named_parameters(remove_duplicate=False):
                if name not in values:
                    continue
                if masters.has(p):
                    masters.set(p, values[name])
                elif id(p) in index:  # owned elsewhere
                    masters.mirror(p, values[name])
        masters.mark_current(model.parameters())

    def _require_masters(self, what: str) -> MasterSet:
        if self.masters is None:
            raise no_masters_error(what)
        return self.masters


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the caller checked is set."""
    g = p.grad
    assert g is not None  # parts hold params with a gradient only
    return g
