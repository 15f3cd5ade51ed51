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

[Note: Bucket group state]
A group is the only writer of its state: the :class:`GroupState`, the per-bucket reduction
records (:class:`_Reduction`: params still to stage, staging buffer, in-flight reduce-scatter,
used params, clipped flag), the ``grad_fresh`` flag of its shardkit-optim ``FlatBucket`` s
(through their public ``mark_reduced`` / ``mark_consumed``), its stepper and its param gathers.
The wrapper's backward pass (``shardkit.ddp._reducer``) decides *when* (bucket order over
every group, the staging pool) and calls the group's methods to stage, launch and finish.

- ``IDLE``: no reduced gradient held (after construction, a step whose gathers were waited
  for, ``zero_grad``); a backward under ``no_sync()`` keeps it (``.grad`` accumulates).
- ``REDUCING``: a reduce-scatter of one of its buckets was launched and the group's buckets
  are not all launched and waited for (also the next synchronised backward from ``REDUCED``:
  gradients accumulate into the shards).
- ``REDUCED``: every bucket reduced and waited for; the shards wait for ``step()``.
- ``STEPPED``: the local step ran and consumed the shards (inside ``step()``).
- ``GATHERING``: the param all-gathers are in flight (``overlap_param_gather``); back to
  ``IDLE`` when the last is waited for. The next backward may start first (a bucket no
  forward touched): ``REDUCING`` then, and ``gather.pending`` still names those buckets.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from shardkit.ddp._checks import CLIP, STATE_DICT, agree
from shardkit.ddp._comm import _Comm, _Pending
from shardkit.ddp._config import ShardedDataParallelConfig
from shardkit.ddp._gather import _ParamGather
from shardkit.ddp._placeholders import drop_grads, is_placeholder
from shardkit.ddp._profiling import phase
from shardkit.ddp._reducer import ALIGN, ParamMap, _Reducer, check_clip
from shardkit.optim import (
    FlatBucket,
    ParkedState,
    ShardedOptimizer,
    ShardOwner,
    ShardStepper,
    agree_grad_norm,
    check_clip_args,
    checkpoint_part,
    gather_full_state_dict,
    grad_norm_partial,
    load_full_state_dict,
)
from torch import nn

__all__ = ["BucketGroup", "GroupState", "clip_groups"]

NAME = "shardkit.ddp.ShardedDataParallel"
_closures = itertools.count()
"""Orders the closures run by ``step()`` across groups (``last_closure_loss``)."""


class GroupState(enum.Enum):
    """Where a :class:`BucketGroup` is in its step cycle; see [Note: Bucket group state]."""

    IDLE = "idle"
    REDUCING = "reducing"
    REDUCED = "reduced"
    STEPPED = "stepped"
    GATHERING = "gathering"


@dataclass(eq=False)
class _Reduction:
    """The reduction state of one bucket (the bucket itself is shardkit-optim's layout)."""

    gaps: list[tuple[int, int]]
    """Element ranges covered by no param (padding), zeroed in a fresh staging buffer."""
    pending: set[int] = field(default_factory=set)
    """Positions (in ``params``) whose gradient this backward has not staged yet."""
    used: set[int] = field(default_factory=set)
    """Positions of the params that staged a real gradient on this rank since the grad shard
    was last consumed (see [Note: Per-param fragments] in ``shardkit.optim._shard_stepper``)."""
    staging: torch.Tensor | None = None
    """The bucket's staging buffer (a prefix of ``base``) while it holds one."""
    base: torch.Tensor | None = None
    """The pool buffer ``staging`` is a prefix of (given back when the reduction finishes)."""
    work: _Pending | None = None
    """The in-flight reduce-scatter."""
    out: torch.Tensor | None = None
    """Where the in-flight reduce-scatter writes (``grad_shard`` or a temporary)."""
    add_out: bool = False
    """Whether the temporary ``out`` is added to ``grad_shard`` (else copied into it)."""
    clipped: bool = False
    """The live reduced gradient was clipped (see [Note: Clip agreement])."""


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
        where: The layout's one param map (``shardkit.ddp._reducer.param_map``), shared.
    """

    name = NAME

    def __init__(
        self,
        index: int,
        opt: ShardedOptimizer,
        comm: _Comm,
        config: ShardedDataParallelConfig,
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
        self.reductions = [_Reduction(_gaps(b), set(range(len(b.params)))) for b in buckets]
        self.stepper = ShardStepper(
            buckets, type(opt.optim), opt.param_groups, dict(opt.defaults), self.comm.rank,
            opt.master_dtype, master_remainder=opt.master_remainder,
        )  # fmt: skip
        _allocate_grad_shards(buckets)
        drained = weakref.WeakMethod(self._gathers_drained)  # the guard holds the gather
        self.gather = _ParamGather(
            self.comm,
            self.config.overlap_param_gather,
            self._module_buckets(module),
            buckets,
            lambda: _call(drained),
        )
        self.state = GroupState.IDLE

    def scratch_bytes(self) -> int:
        """Bytes of scratch the local step borrows from the staging pool."""
        return self.stepper.scratch_bytes()

    def params(self) -> list[torch.Tensor]:
        """The optimizer's params, in its global order."""
        return [p for g in self.opt.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ backward side
    # Called by the wrapper's backward pass (shardkit.ddp._reducer), which keeps the bucket
    # order over every group: see [Note: Staging and launch order] there.
    def begin_pass(self) -> None:
        """Every param of every bucket is still to stage: the start of a reduction pass."""
        for b, r in zip(self.buckets, self.reductions, strict=True):
            r.pending = set(range(len(b.params)))

    def is_pending(self, k: int, i: int) -> bool:
        """Whether param ``i`` of bucket ``k`` (position in the group) is still to stage."""
        return i in self.reductions[k].pending

    def pending(self, k: int) -> list[int]:
        """The positions of bucket ``k`` still to stage, ascending."""
        return sorted(self.reductions[k].pending)

    def wire_dtype(self, k: int) -> torch.dtype:
        """The dtype bucket ``k`` is staged and reduced in. See [Note: Reduce dtype]."""
        b = self.buckets[k]
        return b.dtype if self.config.wire_dtype is None else self.config.wire_dtype

    def has_staging(self, k: int) -> bool:
        """Whether bucket ``k`` holds a staging buffer."""
        return self.reductions[k].staging is not None

    def take_staging(self, k: int, base: torch.Tensor) -> None:
        """Gives bucket ``k`` the pool buffer ``base`` as its staging buffer (padding zeroed)."""
        r = self.reductions[k]
        r.base = base
        r.staging = base[: self.buckets[k].numel]
        for start, end in r.gaps:
            r.staging[start:end].zero_()

    def grad_view(self, k: int, i: int) -> torch.Tensor:
        """A zeroed view of param ``i``'s slice of bucket ``k``'s staging buffer, for backward
        to accumulate into ([Note: Gradients as bucket views])."""
        b, staging = self.buckets[k], self.reductions[k].staging
        assert staging is not None  # the pass gives a staging buffer first
        view = staging[b.offsets[i] : b.offsets[i] + b.params[i].numel()].view_as(b.params[i])
        view.zero_()
        return view

    def stage(self, k: int, i: int, grad: torch.Tensor | None, in_place: bool = False) -> None:
        """Stages param ``i``'s gradient of bucket ``k``, times ``1/N`` ([Note: Staging and
        launch order]); ``in_place``: ``grad`` is its staging view, accumulated by backward."""
        b, r = self.buckets[k], self.reductions[k]
        r.pending.discard(i)
        scale = 1.0 / self.comm.world
        if in_place:
            r.used.add(i)  # See [Note: Per-param fragments] in shardkit.optim._shard_stepper
            assert grad is not None
            grad.mul_(scale)
            return
        assert r.staging is not None  # the pass gives a staging buffer first
        p = b.params[i]
        view = r.staging[b.offsets[i] : b.offsets[i] + p.numel()].view_as(p)
        if grad is None or is_placeholder(grad):  # no new gradient in this pass
            view.zero_()
            return
        r.used.add(i)  # See [Note: Per-param fragments] in shardkit.optim._shard_stepper
        g = grad.detach()
        if view.dtype == g.dtype:
            torch.mul(g, scale, out=view)
        elif view.element_size() <= g.element_size():  # scale, then cast ([Note: Reduce dtype])
            view.copy_(g.mul_(scale))  # in place: no temporary; .grad is dropped next
        else:  # a wider reduce dtype: upcast first, scale in it ([Note: Reduce dtype])
            view.copy_(g).mul_(scale)

    def ready(self, k: int) -> bool:
        """Whether every param of bucket ``k`` is staged (it may launch)."""
        return not self.reductions[k].pending

    def launch(self, k: int) -> None:
        """Launches bucket ``k``'s reduce-scatter into its grad shard ([Note: Staging and
        launch order], [Note: Reduce dtype])."""
        b, r = self.buckets[k], self.reductions[k]
        assert r.staging is not None  # every param staged (possibly zeros) before launch
        assert b.grad_shard is not None  # allocated with the layout
        if self.wire_dtype(k) == b.dtype and b.grad_fresh:
            out = b.grad_shard
        else:  # in place, cast or added into the shard when done
            out = r.staging[self.comm.rank * b.shard : (self.comm.rank + 1) * b.shard]
        r.out = out
        r.add_out = not b.grad_fresh
        b.mark_reduced()
        r.clipped = False
        self.state = GroupState.REDUCING
        with phase("reduce_scatter", b.index):  # See [Note: Profiler ranges]
            r.work = self.comm.reduce_scatter(out, r.staging)

    def finish(self, k: int) -> torch.Tensor:
        """Waits for bucket ``k``'s reduce-scatter, folds it into the grad shard, and returns
        its staging buffer (the pool's) to the caller."""
        b, r = self.buckets[k], self.reductions[k]
        self.comm.wait(r.work)
        r.work = None
        if r.out is not None and b.grad_shard is not None and r.out is not b.grad_shard:
            if r.add_out:
                b.grad_shard.add_(r.out)
            else:
                b.grad_shard.copy_(r.out)
        r.out = None
        base, r.base, r.staging = r.base, None, None
        assert base is not None  # launched buckets hold a staging buffer
        if self.state is GroupState.REDUCING and all(
            x.work is None and not x.pending for x in self.reductions
        ):
            self.state = GroupState.REDUCED
        return base

    def has_reduced_grads(self) -> bool:
        """Whether a reduced gradient waits for ``step()`` / ``zero_grad()``."""
        return any(not b.grad_fresh for b in self.buckets)

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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.last_closure_loss, self.closure_order = loss, next(_closures)
        with phase("step"):  # See [Note: Profiler ranges] in shardkit.ddp._profiling
            # Hyper-parameters, requires_grad and the call itself, agreed before any shard
            # moves (shardkit-optim's [Note: Call agreement]).
            self.opt.check_step(self._trainable_error())
            self.wait_params()
            self.reducer.wait_inflight()  # every group's: the pool is the step's scratch
            unused = self._global_unused()
            with phase("local_step"):  # See [Note: Staging lifetime] in shardkit.ddp._reducer
                scratch = self.reducer.idle_buffers()
                self.stepper.step(unused, scratch=scratch)
            self._consume()
            self.state = GroupState.STEPPED
            self.reducer.trim_pool()
            with phase("all_gather"):
                self.gather.issue(self.buckets)
            self.state = GroupState.GATHERING if self.gather.pending else GroupState.IDLE
        return loss

    def _global_unused(self) -> set[tuple[int, int]]:
        """``(bucket index, position)`` of the params of the group that no rank used since
        the last step: one all-reduce (MAX) of a byte per param. See [Note: Per-param
        fragments] in ``shardkit.optim._shard_stepper``."""
        live = [(b, r) for b, r in zip(self.buckets, self.reductions, strict=True)
                if not b.grad_fresh]  # fmt: skip
        if not live:  # nothing reduced since the last step (agreed: launches are collective)
            return set()
        used = [i in r.used for b, r in live for i in range(len(b.params))]
        mask = torch.tensor(used, dtype=torch.uint8, device=live[0][0].device)
        with phase("usage"):
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

    def _consume(self) -> None:
        """Marks the grad shards consumed (after a step or ``zero_grad``)."""
        for b, r in zip(self.buckets, self.reductions, strict=True):
            b.mark_consumed()  # the next reduce-scatter overwrites the shard
            r.used.clear()
            r.clipped = False

    def _module_buckets(self, module: nn.Module) -> dict[nn.Module, list[int]]:
        """Buckets (indices) of the group's params each submodule owns directly (its forward
        pre-hook waits for their gathers: [Note: Deferred param gather] in
        ``shardkit.ddp._gather``)."""
        out: dict[nn.Module, list[int]] = {}
        for sub in module.modules():
            places = [self.where.get(id(p)) for p in sub.parameters(recurse=False)]
            own = sorted({self.buckets[w[1]].index for w in places
                          if w is not None and w[0] == self.index})  # fmt: skip
            if own:
                out[sub] = own
        return out

    def _gathers_drained(self) -> None:
        if self.state is GroupState.GATHERING:
            self.state = GroupState.IDLE

    def wait_params(self) -> None:
        """Waits for the group's param all-gathers still in flight."""
        self.gather.wait_all()

    # ------------------------------------------------------------------ ShardOwner: grads
    def discard_gradients(self) -> None:
        """Drops the reduced gradients and the pending gradient factors (``zero_grad``)."""
        self.reducer.finish_all()  # not the param gathers: see [Note: Deferred param gather]
        self._consume()
        self.stepper.drop_factors()
        self.state = GroupState.GATHERING if self.gather.pending else GroupState.IDLE

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
        live = [r for b, r in zip(self.buckets, self.reductions, strict=True)
                if not b.grad_fresh and b.grad_shard is not None]  # fmt: skip
        return bool(live), any(r.clipped for r in live)

    def mark_clipped(self) -> None:
        """Records that the live reduced gradients were clipped."""
        for b, r in zip(self.buckets, self.reductions, strict=True):
            if not b.grad_fresh:
                r.clipped = True

    def unscale_for_scaler(self, inv_scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        self.reducer.finish_all()
        return self.stepper.unscale(self.buckets, inv_scale)

    def drop_grad_factors(self) -> None:
        self.stepper.drop_factors()

    # ------------------------------------------------------------------ ShardOwner: state
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
        agree(STATE_DICT, self.opt)  # See [Note: Wrapper agreements]
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


# ---------------------------------------------------------------------- clipping
def clip_groups(groups: Sequence[BucketGroup], max_norm: float, norm_type: float) -> torch.Tensor:
    """Clips the reduced gradients of ``groups`` by their global norm (over every rank's
    shard); returns the norm. Collective. The norm is shardkit-optim's one sharded clip (its
    [Note: Sharded grad norm]); the flags: [Note: Clip agreement] in ``shardkit.ddp._reducer``."""
    max_f, norm_f = check_clip_args(max_norm, norm_type)
    first = groups[0]
    reducer, comm = first.reducer, first.comm
    agree(CLIP, first.opt)  # See [Note: Wrapper agreements]
    with phase("clip_grad_norm"):
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
def _call(method: weakref.WeakMethod[Callable[[], None]]) -> None:
    fn = method()
    if fn is not None:
        fn()


def _allocate_grad_shards(buckets: Sequence[FlatBucket]) -> None:
    """Gives every bucket its ``grad_shard``: views of one zeroed buffer per (dtype, device),
    allocated once with the layout (see [Note: Staging lifetime] in
    ``shardkit.ddp._reducer``)."""
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for b in buckets:
        if b.grad_shard is None:
            key = (b.dtype, b.device)
            sizes[key] = sizes.get(key, 0) + -(-b.shard // ALIGN) * ALIGN
    flats = {key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
    offsets = dict.fromkeys(sizes, 0)
    for b in buckets:
        if b.grad_shard is None:
            key = (b.dtype, b.device)
            b.attach_grad_shard(flats[key][offsets[key] : offsets[key] + b.shard])
            offsets[key] += -(-b.shard // ALIGN) * ALIGN


def _gaps(b: FlatBucket) -> list[tuple[int, int]]:
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
