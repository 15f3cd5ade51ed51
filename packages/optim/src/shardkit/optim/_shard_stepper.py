"""The local step of a rank's shards of flat buckets (the step half of ZeRO-2's engine).

:class:`ShardStepper` is the one owner of a ZeRO-2 rank's sharded optimizer state: each param
group of the sharded optimizer becomes one group of a *local* optimizer of the same
class and hyper-parameters, whose params are what this rank owns (see [Note: Owner-contiguous
buckets] in ``shardkit.optim._flat``), one tensor per param: for a fragment bucket, the part of each param that falls in
the rank's range of the flat buffer, as a 1-D view; for a whole-param bucket, the params it
owns. Their ``.grad`` are views of the bucket's reduced ``grad_shard``. With ``master_dtype``
(shardkit-optim's [Note: Master weights]) each stepped tensor of another dtype gets a master
copy in ``master_dtype``, created from the live values, which the local optimizer steps
instead; the new values are cast back into the buffer after the step, and the gradients are
upcast just before it, bucket by bucket, with the pending factors (clip coefficient) applied in
fp32 (see [Note: Stepping masters bucket by bucket]). The masters are a
:class:`~shardkit.optim._master_set.MasterSet` of the entries' stepped tensors, the one
implementation ZeRO-1 uses too.

[Note: Stepping masters bucket by bucket]
The fp32 gradients of the masters are not all alive at once: the local optimizer steps the
tensors without masters first (their gradients are views of the grad shards), then, for each
bucket whose tensors have masters, upcasts that bucket's gradients into one scratch buffer,
steps those masters and casts them back into the params, as shardkit-optim's ZeRO-1 steps its
masters chunk by chunk ([Note: Master weights]). Every tensor is stepped once per step with the
same gradient, state and hyper-parameters, so an element-wise optimizer gives the same bits as
one step over all of them (each tensor keeps its own step count). The scratch is memory the
driver lends (``step(scratch=...)``: shardkit-ddp lends its idle staging buffers, sized for it
with :meth:`ShardStepper.scratch_bytes`), so no step allocates a gradient-sized tensor; without
a buffer that fits, each bucket's scratch is allocated for the step (logged once).

[Note: Per-param fragments]
A fragment bucket's range is stepped as one tensor per param piece, not as one flat tensor,
so that every param keeps its own optimizer state *and its own step count*, as with a plain
optimizer: a param that no rank used in a step gets no gradient (``.grad`` is ``None`` for the
local optimizer) and is skipped, its values and state unchanged, exactly as DDP
(``find_unused_parameters=True``) + the plain optimizer leave it; the next time it is used,
Adam's bias correction sees its own count. The pieces of one param on different ranks carry
the same scalar state (they see the same global usage), so a full state dict is the pieces'
per-element state concatenated and the scalars of any piece. Which params no rank used is
the driver's to say (``unused`` of :meth:`ShardStepper.step`): shardkit-ddp OR-s a per-rank
usage mask over the ranks with one small all-reduce per step.

[Note: Remainder masters under ZeRO-2]
With ``master_remainder=True`` each bf16 stepped tensor keeps its exact fp32 master as itself
plus an int16 remainder, stepped through a handle ([Note: Remainder masters] in
``_master_set.py``): the remainders are views of one flat int16 buffer per device, 2 bytes per
element where an fp32 master takes 4. The joined masters sit in the step's lent scratch beside
the upcast gradients; a bucket is stepped in as many parts as it takes to fit the scratch of
fp32 masters (:meth:`ShardStepper.scratch_bytes`: one bucket's upcast gradients), so
remainders do not make the driver keep more staging memory (only a single piece larger than
half of it needs more: its gradient and joined master at once). Version counters ([Note:
Params written outside the optimizer]): the engine's own writes do not count: the split and
the param all-gather write views of the bucket's flat buffer, which share no version counter
with the params (their ``.data`` was re-pointed at it); where the stepped tensor is the param
itself (whole-param buckets) its counter is recorded after the write-back.

[Note: Fused steps of cut params]
Element-wise arithmetic is the same on a piece as on the whole param, except in one place:
torch's fused CPU Adam / AdamW kernel (``fused=True``) computes a tensor's vectorised body and
its scalar tail differently (the last bit of ``exp_avg_sq`` may differ, measured on torch
2.13), so a piece that starts or ends off the vector width may not be bit for bit the whole
param's step (within 1e-6 relative). The foreach and single-tensor paths, and every param cut
between blocks (compact state: [Note: Block-aligned fragment buckets] in
``shardkit.optim._flat``; blocks are multiples of every vector width), are exact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch
from shardkit.optim._clip import block_norms
from shardkit.optim._compact import CompactTensor
from shardkit.optim._compact_optim import set_global_numels
from shardkit.optim._flat import FlatBucket
from shardkit.optim._master import unscale_grads
from shardkit.optim._master_set import (
    GradFactors,
    MasterSet,
    Scratch,
    ShardPart,
    Stepped,
    pack,
    step_shard,
)
from shardkit.optim._state import _hyperparams as hyperparams
from shardkit.optim._state import allocate_moments, share_hyperparams
from torch.optim import Optimizer

__all__ = ["ShardEntry", "ShardStepper"]

logger = logging.getLogger("shardkit.optim")
_logged_no_scratch = False


@dataclass(eq=False)
class ShardEntry:
    """One tensor the local optimizer steps: a param, or this rank's piece of one."""

    bucket: FlatBucket
    """The bucket the param lives in."""
    position: int
    """Position of the param in the bucket."""
    start: int
    """Start of its gradient in ``bucket.grad_shard``."""
    stepped: Stepped
    """The stepped tensor and its master (``_master_set.py``): the param itself (whole-param
    bucket) or a 1-D piece of it (fragment bucket), a view of the bucket's buffer."""
    lo: int = 0
    """First element of the param this entry covers (0 for a whole param)."""

    @property
    def tensor(self) -> torch.Tensor:
        """The model-side tensor (a view of the bucket's buffer)."""
        return self.stepped.tensor

    @property
    def master(self) -> torch.Tensor | None:
        """Its master in ``master_dtype`` (stepped instead of ``tensor``), a remainder master's
        handle ([Note: Remainder masters]), or ``None``."""
        return self.stepped.master

    @property
    def remainder(self) -> torch.Tensor | None:
        """With ``master_remainder``, the int16 remainder of a bf16 tensor."""
        return self.stepped.remainder

    @property
    def opt(self) -> torch.Tensor:
        """What the local optimizer steps: the master, else the tensor."""
        return self.stepped.opt

    @property
    def fragment(self) -> bool:
        """Whether this is a piece of a fragment bucket."""
        return self.bucket.elementwise

    @property
    def param(self) -> torch.Tensor:
        """The whole param this entry steps (a part of)."""
        return self.stepped.param

    def master_value(self) -> torch.Tensor:
        """The exact master value (:meth:`Stepped.value`)."""
        return self.stepped.value()

    def set_master(self, value: torch.Tensor | None) -> None:
        """Sets the master exactly from ``value`` (or the live tensor when ``None``):
        :meth:`Stepped.set`."""
        self.stepped.set(value)

    def grad(self) -> torch.Tensor:
        """Its part of the bucket's reduced ``grad_shard`` (a view)."""
        shard = self.bucket.grad_shard
        assert shard is not None  # callers check grad_fresh first
        return shard[self.start : self.start + self.tensor.numel()].view_as(self.tensor)


class ShardStepper:
    """Steps this rank's shards of ``buckets`` with a local copy of the optimizer's class.

    Args:
        buckets: The flat buckets of one sharded optimizer (every rank builds the same).
        optim_cls: The optimizer class (``ShardedOptimizer.optim``'s type).
        param_groups: The sharded optimizer's param groups: the local optimizer's groups are
            views of them ([Note: One owner of hyper-parameters]).
        defaults: Keyword arguments of the optimizer class (``ShardedOptimizer.defaults``).
        rank: This rank, in the buckets' group.
        master_dtype: Dtype of the master copies of lower-precision params, or ``None``.
        master_remainder: With ``master_dtype=torch.float32``: bf16 tensors keep their master
            as an int16 remainder (2 bytes per element instead of 4).
        replicas: The params are replicas updated by weight deltas ([Note: Weight deltas] in
            ``shardkit.optim._wire``): every stepped tensor gets a master (``master_dtype``,
            fp32 when ``None``) and the step writes only the masters (:meth:`delta_shard`
            gives the wire their difference from the replica).
    """

    def __init__(
        self,
        buckets: Sequence[FlatBucket],
        optim_cls: type[Optimizer],
        param_groups: Sequence[dict[str, Any]],
        defaults: dict[str, Any],
        rank: int,
        master_dtype: torch.dtype | None,
        master_remainder: bool = False,
        replicas: bool = False,
    ) -> None:
        self.rank = rank
        if replicas and master_dtype is None:
            master_dtype = torch.float32
        self.master_dtype = master_dtype
        self.master_remainder = master_remainder
        """bf16 tensors keep an int16 remainder instead of an fp32 master ([Note: Remainder
        masters under ZeRO-2])."""
        self.masters: MasterSet | None = (
            None
            if master_dtype is None
            else MasterSet(master_dtype, master_remainder, replicas=replicas)
        )
        """The masters of the stepped tensors of another dtype ([Note: Master weights])."""
        self.factors = GradFactors() if self.masters is None else self.masters.factors
        """Pending gradient factors (loss scaler's ``1/scale``, clip coefficient) for tensors
        with masters, applied in fp32 at the step, in order (the masters' own)."""
        self.entries: list[list[ShardEntry]] = [[] for _ in param_groups]
        """Per param group, the tensors this rank steps."""
        for b in buckets:
            start, _ = b.range_of(rank)
            if b.elementwise:  # See [Note: Per-param fragments]
                for i, lo, hi in b.pieces(rank):
                    piece = Stepped(b.flat[lo:hi], b.params[i])
                    self.entries[b.group].append(
                        ShardEntry(b, i, min(max(lo - start, 0), b.shard), piece, lo - b.offsets[i])
                    )
            else:
                for i, p in b.owned_params(rank):
                    self.entries[b.group].append(
                        ShardEntry(b, i, b.offsets[i] - start, Stepped(p, b.params[i]))
                    )
        if self.masters is not None:  # from the live values, one flat buffer per device
            dtype = self.masters.dtype
            needs = [
                e.stepped
                for e in self.all_entries()
                if e.tensor.dtype != dtype or (replicas and e.tensor.is_floating_point())
            ]
            self.masters.attach(needs, pooled=True)
        self._by_bucket: dict[int, list[ShardEntry]] = {}
        """Bucket index -> the entries stepped in it."""
        for e in self.all_entries():
            self._by_bucket.setdefault(e.bucket.index, []).append(e)
        self._budget = self.scratch_bytes()
        """:meth:`scratch_bytes`, for :meth:`_sub_chunks` (the entries are fixed)."""
        groups = [
            {**hyperparams(g), "params": [e.opt for e in es]}
            for g, es in zip(param_groups, self.entries, strict=True)
        ]
        self.local: Optimizer | None = None
        """The local optimizer (``None`` when this rank owns nothing)."""
        if any(g["params"] for g in groups):
            self.local = optim_cls(groups, **defaults)
            share_hyperparams(param_groups, self.local)  # [Note: One owner of hyper-parameters]
            # compact_state: pieces decide on their whole param ([Note: Block-aligned fragment
            # buckets] in shardkit.optim._flat)
            set_global_numels(self.local, {e.opt: e.param.numel() for e in self.all_entries()})

    def mark_masters_current(self) -> None:
        """Records the version counters of the params with masters: the masters are the truth
        from here (made, or loaded). See [Note: Params written outside the optimizer]."""
        if self.masters is not None:
            self.masters.mark_current(e.param for e in self.all_entries())

    def reseed(self, param: torch.Tensor) -> None:
        """The master of ``param`` (if it has one) becomes its current value: it was re-linked
        into its bucket with new values ([Note: Params that left their bucket] in
        ``shardkit.optim._relink``)."""
        if self.masters is not None and self.masters.has(param):
            self.masters.set(param, None)
            self.masters.mark_current([param])

    def drop_factors(self) -> None:
        """Forgets the pending gradient factors (the loss scaler's ``1/scale``, a clip
        coefficient) queued for the tensors with masters: the step was skipped, or the
        gradients they were meant for were dropped (``zero_grad``)."""
        self.factors.clear()

    def all_entries(self) -> list[ShardEntry]:
        """Every entry, group by group."""
        return [e for es in self.entries for e in es]

    def scratch_bytes(self) -> int:
        """Bytes of scratch one step needs: the upcast gradients of the largest bucket's tensors
        with masters (0 without masters), or one remainder tensor's gradient and joined master
        if that is more. See [Note: Stepping masters bucket by bucket]."""
        masters = self.masters
        if masters is None:
            return 0
        per_bucket: dict[int, int] = {}
        largest = 0
        for e in self.all_entries():
            if e.master is not None:
                n = masters.grad_bytes(e.stepped)
                per_bucket[e.bucket.index] = per_bucket.get(e.bucket.index, 0) + n
                largest = max(largest, masters.cost(e.stepped))
        return max(max(per_bucket.values(), default=0), largest)

    def _sub_chunks(self, chunk: list[ShardEntry]) -> list[list[ShardEntry]]:
        """``chunk`` cut so that each part's scratch fits :meth:`scratch_bytes`: remainder
        masters need their joined value beside the gradient, so a bucket of them is stepped
        in two or more parts rather than borrowing twice the scratch of fp32 masters."""
        masters = self.masters
        assert masters is not None  # chunks hold entries with masters only
        return pack(chunk, lambda e: masters.cost(e.stepped), self._budget)

    def state_bytes(self) -> int:
        """Bytes of masters and optimizer state held by this rank."""
        n = 0
        if self.masters is not None:
            held = self.masters.nbytes()
            n += held["remainders"] + held["masters"]
        if self.local is not None:
            for e in self.all_entries():
                for v in self.local.state.get(e.opt, {}).values():
                    if isinstance(v, torch.Tensor):
                        n += v.numel() * v.element_size()
                    elif isinstance(v, CompactTensor):
                        n += v.nbytes
        return n

    # ------------------------------------------------------------------ step
    def step(
        self,
        unused: Set[tuple[int, int]] = frozenset(),
        scratch: Sequence[torch.Tensor] = (),
    ) -> None:
        """One local step on the reduced gradients; see the module docstring.

        Args:
            unused: ``(bucket index, position)`` of the params no rank used since the last
                step; they are skipped (see [Note: Per-param fragments]).
            scratch: Contiguous tensors nothing else uses during the call (any dtype; their
                contents are overwritten): the upcast gradients of the masters are written into
                the first one on the right device with :meth:`scratch_bytes` bytes. See [Note:
                Stepping masters bucket by bucket].
        """
        local = self.local
        if local is None:
            self.factors.clear()
            return
        masters = self.masters
        lent: Scratch | None = None
        reseed: list[Stepped] = []
        if masters is not None:
            dtype = masters.dtype

            def lent(
                device: torch.device, n: int, joined: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
                both = _scratch(n + joined, dtype, device, scratch)
                return both[:n], both[n:]

            # See [Note: Params written outside the optimizer] (the params' gathers are done).
            reseed = [e.stepped for e in self.all_entries()]
        step_shard(masters, self.factors, reseed, self._parts(local, unused), lent)

    def _parts(self, local: Optimizer, unused: Set[tuple[int, int]]) -> Iterator[ShardPart]:
        """ZeRO-2's parts of [Note: One shard step]: the pieces with a fresh reduced gradient
        and no master in one part, then those with masters bucket by bucket, each bucket's cut
        by the scratch lent ([Note: Stepping masters bucket by bucket]); the local optimizer
        steps the pieces whose ``.grad`` is set (the others have none)."""
        plain: list[ShardEntry] = []
        chunks: dict[int, list[ShardEntry]] = {}  # bucket index -> entries with masters
        for e in self.all_entries():
            e.opt.grad = None
            if not (
                e.bucket.grad_fresh
                or e.bucket.grad_shard is None
                or (e.bucket.index, e.position) in unused
            ):
                (plain if e.master is None else chunks.setdefault(e.bucket.index, [])).append(e)
        stepped = [e.opt for e in plain] + [e.opt for es in chunks.values() for e in es]
        # CUDA only: [Note: Moments in one allocation]
        allocate_moments(local, [t for t in stepped if t.device.type == "cuda"])
        if plain:

            def run_plain() -> None:
                for e in plain:
                    e.tensor.grad = e.grad()
                local.step()
                for e in plain:
                    e.tensor.grad = None

            yield ShardPart(run_plain)
        for chunk in chunks.values():
            for part in self._sub_chunks(chunk):
                # the local step is called from here (allocations it makes, the optimizer state
                # of the first step, are the stepper's: shardkit.testing's LargeAllocations
                # names this frame)
                yield ShardPart(
                    lambda: local.step(), [e.stepped for e in part], [e.grad() for e in part]
                )

    # ------------------------------------------------------------------ loss scaling
    def has_master(self, b: FlatBucket) -> bool:
        """Whether the bucket's tensors are stepped through masters (another dtype, or
        replicas)."""
        masters = self.masters
        return masters is not None and (masters.replicas or b.dtype != masters.dtype)

    def delta_shard(self, b: FlatBucket, out: torch.Tensor) -> None:
        """Writes ``exact - replica`` of this rank's range of bucket ``b`` into ``out`` (fp32,
        the shard's size): each stepped tensor's master minus the tensor, 0 elsewhere (the
        padding: the replica is exact there). See [Note: Weight deltas] in
        ``shardkit.optim._wire``."""
        with torch.no_grad():
            out.zero_()
            for e in self._by_bucket.get(b.index, ()):
                if e.master is not None:
                    n = e.tensor.numel()
                    torch.sub(
                        e.master_value().reshape(-1),
                        e.tensor.detach().reshape(-1),
                        out=out[e.start : e.start + n],
                    )

    def unscale(
        self, buckets: Sequence[FlatBucket], inv_scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """``ShardedGradScaler``'s unscale over this rank's reduced grad shards.

        Checks every live shard for inf/nan (one flag per device, torch's format; the scaler
        then agrees on it over the group, shardkit-optim's [Note: Agreed found-inf]),
        multiplies the shards without masters by ``inv_scale`` in place, and queues
        ``inv_scale`` as the first factor of the shards with masters, so it is applied in fp32
        to the upcast gradient at the step (shardkit-optim's [Note: Master weights]).
        """
        half = [b.index for b in buckets if b.dtype == torch.float16 and not self.has_master(b)]
        if half:  # decided by the agreed bucket plan: raises on every rank
            raise ValueError(
                f"ShardedGradScaler would unscale float16 gradients in float16 (buckets "
                f"{half[:5]}), where small gradients underflow; torch's GradScaler refuses the "
                f"same. Build the ShardedOptimizer with master_dtype=torch.float32."
            )
        found = unscale_grads(
            (
                (b.grad_shard, self.has_master(b))
                for b in buckets
                if not b.grad_fresh and b.grad_shard is not None
            ),
            inv_scale,
        )
        if self.master_dtype is not None:
            self.factors.add(inv_scale)
        return found

    # ------------------------------------------------------------------ clipping
    # Clipping by the global norm of the reduced gradients is the driver's (shardkit-ddp's
    # ``ShardedDataParallel``), through shardkit-optim's one implementation (see [Note: Sharded
    # grad norm] in ``shardkit.optim._clip``): ``grad_norms`` of one or more steppers, combined
    # with ``grad_norm_partial`` and ``agree_grad_norm``, then ``apply_clip`` on each. The
    # driver keeps the padding elements of a shard at zero gradient, so they add nothing to the
    # norm. Shards with masters count times the pending factors (the loss scaler's ``1/scale``
    # after ``unscale_``), as the step will use them.
    def grad_norms(
        self,
        buckets: Sequence[FlatBucket],
        norm_type: float,
        scratch: Sequence[torch.Tensor] = (),
    ) -> list[torch.Tensor]:
        """fp32 ``norm_type`` norms of this rank's live reduced gradients in ``buckets``, in
        blocks of ``BLOCK`` elements (:func:`~shardkit.optim.block_norms`, one tensor per live
        shard), for :func:`~shardkit.optim.grad_norm_partial`.

        ``scratch``: as for :meth:`step`, for the fp32 copy of a shard of another dtype.
        """
        live = [b for b in buckets if not b.grad_fresh and b.grad_shard is not None]
        return [block_norms(self._scaled(b, scratch), norm_type) for b in live]

    def apply_clip(self, buckets: Sequence[FlatBucket], coef: torch.Tensor) -> None:
        """Multiplies the live shards by ``coef`` (queued as a factor for shards with masters,
        applied in fp32 to the upcast gradient at the step)."""
        for b in buckets:
            shard = b.grad_shard
            if b.grad_fresh or shard is None or self.has_master(b):
                continue
            shard.mul_(coef.to(device=shard.device, dtype=shard.dtype))
        if self.master_dtype is not None:
            self.factors.add(coef)

    def _scaled(self, b: FlatBucket, scratch: Sequence[torch.Tensor]) -> torch.Tensor:
        """The bucket's reduced grad shard in fp32, times the pending factors (the loss
        scaler's ``1/scale``) when its tensors have masters: what the step will use."""
        shard = b.grad_shard
        assert shard is not None  # callers keep live buckets only
        if shard.dtype == torch.float32 and not (self.has_master(b) and len(self.factors)):
            return shard
        g = _scratch(shard.numel(), torch.float32, shard.device, scratch).copy_(shard)
        if self.has_master(b):
            self.factors.apply(g)
        return g


def _scratch(
    numel: int, dtype: torch.dtype, device: torch.device, scratch: Sequence[torch.Tensor]
) -> torch.Tensor:
    """A flat ``dtype`` tensor of ``numel`` elements: a view of the first lent scratch buffer
    on ``device`` that holds it, else a temporary (logged once). See [Note: Stepping masters
    bucket by bucket]."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    for t in scratch:
        if t.device == device and t.is_contiguous() and t.numel() * t.element_size() >= nbytes:
            return t.reshape(-1).view(torch.uint8)[:nbytes].view(dtype)
    global _logged_no_scratch
    if not _logged_no_scratch:
        _logged_no_scratch = True
        logger.info(
            "ShardStepper: no scratch buffer of %d bytes on %s was lent to the step; the fp32 "
            "gradients of each bucket are allocated for the step instead (logged once)",
            nbytes,
            device,
        )
    return torch.empty(numel, dtype=dtype, device=device)
