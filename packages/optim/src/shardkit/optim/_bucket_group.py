"""One owner per wrapped optimizer: :class:`BucketGroup`, the ZeRO-2 state of its buckets.

[Note: Optimizer hand-over]
The training loop keeps calling the ``ShardedOptimizer``'s ``step()``, ``zero_grad()``,
``clip_grad_norm()`` and state-dict methods, but once wrapped its params' gradients live in
the wrapper's grad shards, not in ``.grad``, and its params in the wrapper's flat buffers. So
at construction the wrapper builds one :class:`BucketGroup` per optimizer and attaches it as
that optimizer's ``ShardOwner`` (shardkit-optim's public [Note: Step drivers]): the optimizer
releases what it had allocated for its own step (its flat sync buffers, inner optimizer state,
master copies) and forwards ``step``, ``zero_grad``, ``clip_grad_norm``, the state dicts,
sharded checkpoints and ``ShardedGradScaler``'s unscale to the group, which runs them itself
(one hop). ``add_param_group`` / ``refresh_trainable`` / ``set_partition`` raise (the bucket
layout is fixed at construction).

``optimizer.step()`` then runs, in order: the closure (if any), the optimizer's per-step
agreement (hyper-parameters equal on every rank, ``check_step``) with the group's
``requires_grad`` check, *before* any shard moves; then the wait for the reductions, the local
step of the shards (shardkit-optim's ``ShardStepper``) and the param all-gather.

With several optimizers (fairscale's ``ShardedDataParallel(model, [opt1, opt2])``) every
backward reduces the gradients of all of them; ``opt_k.step()`` steps and gathers only
``opt_k``'s buckets and consumes only their gradients, so gradients of an optimizer that did
not step yet accumulate over the next backward, as ``.grad`` does with DDP.

The group does the work of its buckets' cycle (staging copies, collectives, the local step,
the gathers); what decides the next move is its :class:`~shardkit.optim._lifecycle.GroupLife`,
written only by that state machine's transitions (see [Note: Bucket group state] in
``shardkit.optim._lifecycle``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._agreement import agree_call, register_call
from shardkit.optim._clip import agree_grad_norm, check_clip_args, grad_norm_partial
from shardkit.optim._driver import ShardOwner
from shardkit.optim._flat import FlatBucket, aligned_views
from shardkit.optim._gather import _ParamGather
from shardkit.optim._lifecycle import GroupLife, GroupState
from shardkit.optim._options import EngineOptions
from shardkit.optim._placeholders import _ReducedGrad
from shardkit.optim._profiling import NO_RANGE
from shardkit.optim._profiling import zero2_phase as phase
from shardkit.optim._reducer import ALIGN, ParamMap, _Reducer, check_clip, drop_grads
from shardkit.optim._relink import refusal, relink
from shardkit.optim._shard_state import (
    ParkedState,
    checkpoint_part,
    gather_full_state_dict,
    load_full_state_dict,
)
from shardkit.optim._shard_stepper import ShardStepper
from shardkit.optim._sharded_optimizer import ShardedOptimizer
from shardkit.optim._state import global_params
from shardkit.optim._torch_compat import profiling
from shardkit.optim._wire import Codec, Exact, Wire
from torch import nn

__all__ = ["BucketGroup", "GroupState", "agree", "clip_groups"]

NAME = "shardkit.ddp.ShardedDataParallel"
CLIP = register_call("ShardedDataParallel.clip_grad_norm_()")
STATE_DICT = register_call("ShardedDataParallel.optimizer_state_dict()")
_closures = itertools.count()
"""Orders the closures run by ``step()`` across groups (``last_closure_loss``)."""


class BucketGroup(ShardOwner):
    """The ZeRO-2 owner of one wrapped ``ShardedOptimizer``'s buckets.

    Holds the flat params, the grad shards, the reduction state of each bucket, the local
    stepper and the param all-gathers; runs the reduce-scatters it is asked to launch and the
    optimizer's step, state dicts and unscale (``ShardOwner``). See [Note: Optimizer hand-over]
    and [Note: Bucket group state].

    Args:
        index: Position of the optimizer in the wrapper's ``sharded_optimizers``.
        opt: The optimizer.
        comm: The wrapper's communication layer.
        config: The wrapper's options.
        reducer: The wrapper's backward pass (bucket order over every group, staging pool).
        buckets: The optimizer's buckets (``shardkit.optim.build_flat_buckets``).
        module: The wrapped module (which submodule holds which bucket's params).
        where: The layout's one param map (``shardkit.optim._reducer.param_map``), shared.
    """

    name = NAME

    def __init__(
        self,
        index: int,
        opt: ShardedOptimizer,
        comm: Wire,
        config: EngineOptions,
        reducer: _Reducer,
        buckets: list[FlatBucket],
        module: nn.Module,
        where: ParamMap,
    ) -> None:
        self.index = index
        self.opt = opt
        self.comm = comm
        self.config = config
        self.reducer = reducer
        self.parked = ParkedState({}, {})
        """Optimizer state of the params outside the layout (see [Note: Trainable refresh])."""
        self.last_closure_loss: Any = None
        self.closure_order = -1
        """When the closure of ``last_closure_loss`` ran (orders the wrapper's groups)."""
        self.closed = False
        """Whether the wrapper was closed (``Zero2Engine.close``)."""
        self._lay_out(buckets, module, where)

    def rebuild(self, buckets: list[FlatBucket], module: nn.Module, where: ParamMap) -> None:
        """Takes the buckets of a rebuilt layout (``refresh_trainable``; every reduction and
        gather of the old one was waited for)."""
        self._lay_out(buckets, module, where)

    def _lay_out(self, buckets: list[FlatBucket], module: nn.Module, where: ParamMap) -> None:
        opt = self.opt
        self.buckets = buckets
        self.where = where
        """The layout's param map (read only; a param is in it iff it was trainable)."""
        self.shapes = {id(p): p.shape for b in buckets for p in b.params}
        """Each bucketed param's shape in the layout ([Note: Params that left their bucket])."""
        self.life = GroupLife(f"{NAME} (optimizer {self.index})", buckets)
        """The group's state machine: see [Note: Bucket group state]."""
        self.stepper = ShardStepper(
            buckets, opt.optim_class, opt.param_groups, dict(opt.defaults), self.comm.rank,
            opt.master_dtype, master_remainder=opt.master_remainder,
            replicas=self.config.param_wire is not None,
        )  # fmt: skip
        _allocate_grad_shards(buckets)
        self.gather = _ParamGather(
            self.comm,
            self.config.overlap_param_gather,
            self._module_buckets(module),
            buckets,
            self.life,
            None
            if self.config.param_wire is None
            else (self.config.param_wire, self.stepper.delta_shard),
        )

    @property
    def state(self) -> GroupState:
        """Where the group is in its step cycle (its state machine's)."""
        return self.life.state

    def scratch_bytes(self) -> int:
        """Bytes of scratch the local step borrows from the staging pool."""
        return self.stepper.scratch_bytes()

    def params(self) -> list[torch.Tensor]:
        """The optimizer's params, in its global order."""
        return global_params(self.opt.param_groups)

    # ------------------------------------------------------------------ backward side
    # Called by the wrapper's backward pass (shardkit.optim._reducer), which keeps the bucket
    # order over every group: see [Note: Staging and launch order] there.
    def begin_pass(self) -> None:
        """Every param of every bucket is still to stage: the start of a reduction pass."""
        self.life.begin_pass()

    def is_pending(self, k: int, i: int) -> bool:
        """Whether param ``i`` of bucket ``k`` (position in the group) is still to stage."""
        return i in self.life.buckets[k].pending

    def pending(self, k: int) -> list[int]:
        """The positions of bucket ``k`` still to stage, ascending."""
        return sorted(self.life.buckets[k].pending)

    def wire_dtype(self, k: int) -> torch.dtype:
        """The dtype bucket ``k`` is staged in. See [Note: Reduce dtype]."""
        b = self.buckets[k]
        return b.dtype if self.config.wire_dtype is None else self.config.wire_dtype

    def codec(self, k: int) -> Codec:
        """The codec of bucket ``k``'s reduce-scatter (``shardkit.optim._wire``)."""
        if self.config.grad_wire is not None:
            return self.config.grad_wire
        return Exact(self.config.wire_dtype)

    def has_staging(self, k: int) -> bool:
        """Whether bucket ``k`` holds a staging buffer."""
        return self.life.buckets[k].staging is not None

    def take_staging(self, k: int, base: torch.Tensor) -> None:
        """Gives bucket ``k`` the pool buffer ``base`` as its staging buffer (padding zeroed)."""
        staging = self.life.take_staging(k, base)
        for start, end in self.life.buckets[k].gaps:
            staging[start:end].zero_()

    def grad_view(self, k: int, i: int) -> torch.Tensor:
        """A zeroed view of param ``i``'s slice of bucket ``k``'s staging buffer, for backward
        to accumulate into ([Note: Gradients as bucket views])."""
        b, staging = self.buckets[k], self.life.buckets[k].staging
        assert staging is not None  # the pass gives a staging buffer first
        view = staging[b.offsets[i] : b.offsets[i] + b.params[i].numel()].view_as(b.params[i])
        view.zero_()
        return view

    def stage(self, k: int, i: int, grad: torch.Tensor | None, in_place: bool = False) -> None:
        """Stages param ``i``'s gradient of bucket ``k``, times ``1/N`` ([Note: Staging and
        launch order]); ``in_place``: ``grad`` is its staging view, accumulated by backward."""
        b, life = self.buckets[k], self.life
        scale = 1.0 / self.comm.world
        if in_place:
            life.stage(k, i, real=True)
            assert grad is not None
            grad.mul_(scale)
            return
        staging = life.buckets[k].staging
        assert staging is not None  # the pass gives a staging buffer first
        p = b.params[i]
        view = staging[b.offsets[i] : b.offsets[i] + p.numel()].view_as(p)
        if grad is None or type(grad) is _ReducedGrad:  # no new gradient in this pass
            life.stage(k, i, real=False)
            view.zero_()
            return
        life.stage(k, i, real=True)
        g = grad.detach()
        if view.dtype == g.dtype:
            torch.mul(g, scale, out=view)
        elif view.element_size() <= g.element_size():  # scale, then cast ([Note: Reduce dtype])
            view.copy_(g.mul_(scale))  # in place: no temporary; .grad is dropped next
        else:  # a wider reduce dtype: upcast first, scale in it ([Note: Reduce dtype])
            view.copy_(g).mul_(scale)

    def ready(self, k: int) -> bool:
        """Whether every param of bucket ``k`` is staged (it may launch)."""
        return not self.life.buckets[k].pending

    def launch(self, k: int) -> None:
        """Launches bucket ``k``'s reduce-scatter into its grad shard through the wire
        ([Note: Staging and launch order], [Note: Reduce dtype])."""
        b, staging = self.buckets[k], self.life.buckets[k].staging
        assert staging is not None  # every param staged (possibly zeros) before launch
        assert b.grad_shard is not None  # allocated with the layout
        fresh = self.life.launch(k)
        # See [Note: Profiler ranges]
        with phase("reduce_scatter", b.index) if profiling() else NO_RANGE:
            work = self.comm.reduce_scatter(
                staging, b.grad_shard, self.codec(k), add=not fresh, bucket=b.index
            )
            self.life.issued(k, work)

    def finish(self, k: int) -> torch.Tensor:
        """Waits for bucket ``k``'s reduce-scatter (the wire folds it into the grad shard),
        and returns its staging buffer (the pool's) to the caller."""
        self.comm.wait(self.life.buckets[k].work)
        return self.life.finish(k)

    def has_reduced_grads(self) -> bool:
        """Whether a reduced gradient waits for ``step()`` / ``zero_grad()``."""
        return self.life.holds_reduced()

    # ------------------------------------------------------------------ ShardOwner: step
    def step(self, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        """The optimizer's ``step(closure)``; see [Note: Optimizer hand-over].

        A closure (fairscale's loops pass one) is evaluated first, once; its loss is returned
        (and shown by the wrapper's ``last_closure_loss``). The agreements run before any
        shard moves.
        """
        if kwargs:
            raise TypeError(
                f"ShardedOptimizer.step() under ShardedDataParallel takes no extra arguments "
                f"(the local step runs the wrapped optimizer class on the shards), got "
                f"{sorted(kwargs)}"
            )
        if self.closed:
            raise RuntimeError(
                f"{self.opt.__class__.__name__}.step(): the ShardedDataParallel that drives this "
                f"optimizer was closed (close() or the end of its with block); build a new "
                f"ShardedOptimizer and ShardedDataParallel to train again"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.last_closure_loss, self.closure_order = loss, next(_closures)
        # See [Note: Profiler ranges] in shardkit.ddp._profiling
        with phase("step") if profiling() else NO_RANGE:
            # Hyper-parameters, requires_grad and the call itself, agreed before any shard
            # moves (shardkit-optim's [Note: Call agreement]).
            # See [Note: Params that left their bucket] in shardkit.optim._relink
            moved = [(b, i) for b in self.buckets for i in _moved(b)]
            refused = refusal(moved, self.shapes) if moved else None
            self.opt.check_step(self._trainable_error() or refused)
            self.wait_params()
            if moved:
                relink(moved, self.stepper.reseed)
            self.reducer.wait_inflight()  # every group's: the pool is the step's scratch
            unused = self._global_unused()
            # See [Note: Staging lifetime] in shardkit.optim._reducer
            with phase("local_step") if profiling() else NO_RANGE:
                scratch = self.reducer.idle_buffers()
                self.stepper.step(unused, scratch=scratch)
            self.life.stepped()
            self.reducer.trim_pool()
            with phase("all_gather") if profiling() else NO_RANGE:
                self.gather.issue(self.buckets)
            self.life.step_done()
        return loss

    def _global_unused(self) -> set[tuple[int, int]]:
        """``(bucket index, position)`` of the params of the group that no rank used since
        the last step: one all-reduce (MAX) of a byte per param. See [Note: Per-param
        fragments] in ``shardkit.optim._shard_stepper``."""
        live = [(b, r) for b, r in zip(self.buckets, self.life.buckets, strict=True)
                if not b.grad_fresh]  # fmt: skip
        if not live:  # nothing reduced since the last step (agreed: launches are collective)
            return set()
        used = [i in r.used for b, r in live for i in range(len(b.params))]
        mask = torch.tensor(used, dtype=torch.uint8, device=live[0][0].device)
        with phase("usage") if profiling() else NO_RANGE:
            self.comm.all_reduce(mask, op=dist.ReduceOp.MAX)
        if all(used):  # this rank used every param: so did the union
            return set()
        flags = iter(mask.tolist())
        return {(b.index, i) for b, _ in live for i in range(len(b.params)) if not next(flags)}

    def _trainable_error(self) -> str | None:
        """This rank's reason to refuse the step if ``requires_grad`` changed since the layout
        was built (a param is in the layout iff it was trainable then); raised on every rank
        by the optimizer's per-step agreement."""
        where = self.where
        changed = [i for i, p in enumerate(self.params()) if p.requires_grad != (id(p) in where)]
        if not changed:
            return None
        return (
            f"requires_grad changed after ShardedDataParallel was built, on rank "
            f"{self.comm.rank} (params {changed[:5]}, global indices) after the last forward, "
            f"or with auto_refresh_trainable=False: the gradients were reduced in the old "
            f"bucket layout. Change requires_grad before a forward (on every rank alike), or "
            f"call ddp.refresh_trainable() after changing it"
        )

    def _module_buckets(self, module: nn.Module) -> dict[nn.Module, list[int]]:
        """Buckets (indices) of the group's params each submodule owns directly (its forward
        pre-hook waits for their gathers: [Note: Deferred param gather] in
        ``shardkit.optim._gather``)."""
        out: dict[nn.Module, list[int]] = {}
        for sub in module.modules():
            places = [self.where.get(id(p)) for p in sub.parameters(recurse=False)]
            own = sorted({self.buckets[w[1]].index for w in places
                          if w is not None and w[0] == self.index})  # fmt: skip
            if own:
                out[sub] = own
        return out

    def close(self) -> None:
        """The wrapper was closed: ``step()`` raises from now on."""
        self.closed = True

    def wait_params(self) -> None:
        """Waits for the group's param all-gathers still in flight."""
        self.gather.wait_all()

    # ------------------------------------------------------------------ ShardOwner: grads
    def discard_gradients(self) -> None:
        """Drops the reduced gradients and the pending gradient factors (``zero_grad``)."""
        self.reducer.finish_all()  # not the param gathers: see [Note: Deferred param gather]
        self.life.discard()
        self.stepper.drop_factors()

    def zero_grad(self, set_to_none: bool) -> None:
        self.discard_gradients()
        drop_grads(self.params(), set_to_none)

    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float,
        filter_params_fn: Callable[[Any], Any] | None = None,
    ) -> torch.Tensor:
        if filter_params_fn is not None:
            raise ValueError(
                "clip_grad_norm(filter_params_fn=...) is not supported under "
                "ShardedDataParallel: gradients are sharded by element ranges, not params"
            )
        return clip_groups([self], max_norm, norm_type)

    def clip_flags(self) -> tuple[bool, bool]:
        """(the group holds a reduced gradient not consumed yet, one of those was clipped
        already) on this rank. See [Note: Clip agreement]."""
        live = [r for b, r in zip(self.buckets, self.life.buckets, strict=True)
                if not b.grad_fresh and b.grad_shard is not None]  # fmt: skip
        return bool(live), any(r.clipped for r in live)

    def mark_clipped(self) -> None:
        """Records that the live reduced gradients were clipped."""
        self.life.mark_clipped()

    def unscale_for_scaler(self, inv_scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        self.reducer.finish_all()
        return self.stepper.unscale(self.buckets, inv_scale)

    def drop_grad_factors(self) -> None:
        self.stepper.drop_factors()

    # ------------------------------------------------------------------ ShardOwner: state
    def shard_state(self) -> Mapping[torch.Tensor, dict[str, Any]]:
        """This rank's live state of each param with a piece here (see shardkit-optim's
        [Note: Optimizer state under ZeRO-2] in ``shardkit.optim._state``)."""
        local = self.stepper.local
        if local is None:
            return {}
        state = local.state
        return {e.param: state[e.opt] for e in self.stepper.all_entries() if e.opt in state}

    def full_state_dict(
        self, recipient_rank: int = -1, skip: Set[int] = frozenset()
    ) -> dict[str, Any]:
        """The optimizer's full state dict in plain torch format, on every rank (whatever
        ``recipient_rank``). Collective.

        See [Note: Optimizer state format] in ``shardkit.optim._shard_state``.

        Raises:
            ValueError: ``skip`` names params (on every rank: they pass the same): ZeRO-2's
                state is sharded by element ranges, every rank holds part of every param's.
        """
        if skip:
            raise ValueError(
                "consolidate_state_dict(skip=...) is not supported under ShardedDataParallel: "
                "every rank holds part of every param's state. Use save_sharded() instead."
            )
        return self._gather_state(compact=False)

    def _gather_state(self, compact: bool) -> dict[str, Any]:
        """The full state on every rank (collective); compact moments as fp32, or as they are
        with ``compact`` (a checkpoint's items: shardkit-optim's [Note: Compact checkpoint
        items])."""
        agree(STATE_DICT, self.opt)  # See [Note: Wrapper agreements] in shardkit.ddp._checks
        self.reducer.finish_all()
        self.wait_params()
        return gather_full_state_dict(
            self.stepper,
            self.buckets,
            self.opt.param_groups,
            self.comm.group,
            parked=self.parked,
            all_gather=self.comm.all_gather_into,
            compact=compact,
        )

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_params()
        self.parked = load_full_state_dict(
            self.stepper, self.buckets, self.opt.param_groups, state_dict
        )

    # See [Note: DCP sharded checkpoints] in ``shardkit.optim._shard_state``.
    def checkpoint_state_dict(self) -> dict[str, Any]:
        return checkpoint_part(self._gather_state(compact=True), self.comm.rank, self.comm.world)

    def checkpoint_indices(self) -> list[int]:
        return list(range(len(self.params())))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the group's flat params, grad shards and optimizer state (with masters and
        parked state)."""
        return {
            "params": sum(b.flat.numel() * b.flat.element_size() for b in self.buckets),
            "grads": sum(
                b.grad_shard.numel() * b.grad_shard.element_size()
                for b in self.buckets
                if b.grad_shard is not None
            ),
            "optimizer": self.stepper.state_bytes() + self.parked.nbytes(),
        }


def agree(call: str, opt: ShardedOptimizer, digest: int = 0) -> bool:
    """Whether every rank of ``opt``'s group entered ``call`` with the same ``digest``
    (bounded by ``opt.collective_timeout``); see [Note: Call agreement]."""
    same, _, _ = agree_call(call, opt.group, opt.collective_timeout, digest=digest)
    return bool(same)


# ---------------------------------------------------------------------- relinking
def _moved(b: FlatBucket) -> list[int]:
    """Positions of ``b``'s params that are no longer the view of ``flat`` they were laid out
    as (their storage was replaced: ``p.data = t``, a dtype round trip); see [Note: Params that
    left their bucket] in ``shardkit.optim._relink``. Reads ``data_ptr()``: call it with no
    param gather of the bucket pending."""
    base, size, dtype = b.flat.data_ptr(), b.flat.element_size(), b.flat.dtype
    return [
        i
        for i, p in enumerate(b.params)
        if p.dtype is not dtype or (p.numel() > 0 and p.data_ptr() != base + b.offsets[i] * size)
    ]


# ---------------------------------------------------------------------- clipping
def clip_groups(groups: Sequence[BucketGroup], max_norm: float, norm_type: float) -> torch.Tensor:
    """Clips the reduced gradients of ``groups`` by their global norm (over every rank's
    shard); returns the norm. Collective. The norm is shardkit-optim's one sharded clip (its
    [Note: Sharded grad norm]); the flags: [Note: Clip agreement] in ``shardkit.optim._reducer``."""
    max_f, norm_f = check_clip_args(max_norm, norm_type)
    first = groups[0]
    reducer, comm = first.reducer, first.comm
    agree(CLIP, first.opt)  # See [Note: Wrapper agreements] in shardkit.ddp._checks
    with phase("clip_grad_norm") if profiling() else NO_RANGE:
        reducer.finish_all()
        for g in groups:
            g.wait_params()
        buckets = [b for g in groups for b in g.buckets]
        device = buckets[0].device if buckets else torch.device("cpu")
        scratch = reducer.idle_buffers()  # See [Note: Staging lifetime]
        # fp32 block norms, an fp64 partial, one all-gather of one row per rank through the
        # counting layer; the flags ride in the row.
        norms = [n for g in groups for n in g.stepper.grad_norms(g.buckets, norm_f, scratch)]
        each = [g.clip_flags() for g in groups]
        norm = agree_grad_norm(
            grad_norm_partial(norms, norm_f, device),
            max_f,
            norm_f,
            comm.group,
            flags=(any(f[0] for f in each), any(f[1] for f in each)),
            all_gather=comm.all_gather_into,
        )
        check_clip(norm.flags)
        for g in groups:
            g.stepper.apply_clip(g.buckets, norm.coef)
        for g in groups:
            g.mark_clipped()
        return norm.total


# ---------------------------------------------------------------------- layout helpers
def _allocate_grad_shards(buckets: Sequence[FlatBucket]) -> None:
    """Gives every bucket its ``grad_shard``: zeroed views of one buffer per (dtype, device),
    allocated once with the layout (see [Note: Staging lifetime] in
    ``shardkit.optim._reducer``)."""
    fresh = [b for b in buckets if b.grad_shard is None]
    views = aligned_views([(b.dtype, b.device, b.shard) for b in fresh], ALIGN)
    for b, view in zip(fresh, views, strict=True):
        b.attach_grad_shard(view.zero_())
