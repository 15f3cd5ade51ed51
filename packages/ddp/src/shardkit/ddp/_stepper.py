"""Step side of ``ShardedDataParallel``: the local optimizer over this rank's shards.

Each param group of the sharded optimizer becomes one group of a *local* optimizer of the same
class and hyper-parameters, whose params are what this rank owns (see [Note: Owner-contiguous
buckets]), one tensor per param: for a fragment bucket, the part of each param that falls in
the rank's range of the flat buffer, as a 1-D view; for a whole-param bucket, the params it
owns. Their ``.grad`` are views of the bucket's reduced ``grad_shard``. With ``master_dtype``
(shardkit-optim's [Note: Master weights]) each stepped tensor of another dtype gets a master
copy in ``master_dtype``, created from the live values, which the local optimizer steps
instead; the new values are cast back into the buffer after the step, and the gradients are
upcast just before it, bucket by bucket, with the pending factors (clip coefficient) applied in
fp32.

[Note: Per-param fragments]
A fragment bucket's range is stepped as one tensor per param piece, not as one flat tensor,
so that every param keeps its own optimizer state *and its own step count*, as with a plain
optimizer: a param that no rank used in a step gets no gradient (``.grad`` is ``None`` for the
local optimizer) and is skipped, its values and state unchanged, exactly as DDP
(``find_unused_parameters=True``) + the plain optimizer leave it; the next time it is used,
Adam's bias correction sees its own count. The pieces of one param on different ranks carry
the same scalar state (they see the same global usage), so a full state dict is the pieces'
per-element state concatenated and the scalars of any piece. Which params were used is
``_Bucket.used`` (this rank: a real gradient staged since the last step), OR-ed over the ranks
by one small all-reduce of a usage mask per step (``ShardedDataParallel._global_unused``).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch
from shardkit.ddp._layout import _Bucket
from torch.optim import Optimizer

__all__: list[str] = []


def hyperparams(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters (everything but ``params``)."""
    return {k: v for k, v in group.items() if k != "params"}


@dataclass(eq=False)
class _Entry:
    """One tensor the local optimizer steps: a param, or this rank's piece of one."""

    bucket: _Bucket
    position: int
    """Position of the param in the bucket."""
    start: int
    """Start of its gradient in ``bucket.grad_shard``."""
    tensor: torch.Tensor
    """The model-side tensor (a view of the bucket's buffer): the param itself (whole-param
    bucket) or a 1-D piece of it (fragment bucket)."""
    master: torch.Tensor | None
    lo: int = 0
    """First element of the param this entry covers (0 for a whole param)."""

    @property
    def opt(self) -> torch.Tensor:
        return self.tensor if self.master is None else self.master

    @property
    def fragment(self) -> bool:
        return self.bucket.elementwise

    @property
    def param(self) -> torch.Tensor:
        return self.bucket.params[self.position]

    def grad(self) -> torch.Tensor:
        shard = self.bucket.grad_shard
        assert shard is not None  # callers check grad_fresh first
        return shard[self.start : self.start + self.tensor.numel()].view_as(self.tensor)


def fragment_pieces(b: _Bucket, rank: int) -> list[tuple[int, int, int]]:
    """``(position, lo, hi)``: the element range ``[lo, hi)`` of the bucket's buffer that
    ``rank`` steps for each param of fragment bucket ``b`` (a param of no elements belongs to
    the rank whose range holds its offset). See [Note: Per-param fragments]."""
    start, end = b.range_of(rank)
    out = []
    for i, (p, off) in enumerate(zip(b.params, b.offsets, strict=True)):
        n = p.numel()
        lo, hi = max(off, start), min(off + n, end)
        if hi > lo:
            out.append((i, lo, hi))
        elif n == 0 and min(off // max(b.shard, 1), b.world - 1) == rank:
            out.append((i, off, off))
    return out


class _Stepper:
    """Steps this rank's shards with a local copy of the sharded optimizer's class."""

    def __init__(
        self,
        buckets: Sequence[_Bucket],
        optim_cls: type[Optimizer],
        param_groups: Sequence[dict[str, Any]],
        defaults: dict[str, Any],
        rank: int,
        master_dtype: torch.dtype | None,
    ) -> None:
        self.rank = rank
        self.master_dtype = master_dtype
        self.factors: list[torch.Tensor] = []
        self.entries: list[list[_Entry]] = [[] for _ in param_groups]
        for b in buckets:
            start, _ = b.range_of(rank)
            if b.elementwise:  # See [Note: Per-param fragments]
                for i, lo, hi in fragment_pieces(b, rank):
                    piece = b.flat[lo:hi]
                    self.entries[b.group].append(
                        self._entry(
                            b, i, min(max(lo - start, 0), b.shard), piece, lo - b.offsets[i]
                        )
                    )
            else:
                for i, p in b.owned_params(rank):
                    self.entries[b.group].append(self._entry(b, i, b.offsets[i] - start, p, 0))
        groups = [
            {**hyperparams(g), "params": [e.opt for e in es]}
            for g, es in zip(param_groups, self.entries, strict=True)
        ]
        self.local: Optimizer | None = None
        if any(g["params"] for g in groups):
            self.local = optim_cls(groups, **defaults)

    def _entry(self, b: _Bucket, pos: int, start: int, t: torch.Tensor, lo: int) -> _Entry:
        master = None
        if self.master_dtype is not None and t.dtype != self.master_dtype:
            master = t.detach().to(self.master_dtype, copy=True)
        return _Entry(b, pos, start, t, master, lo)

    def all_entries(self) -> list[_Entry]:
        return [e for es in self.entries for e in es]

    def state_bytes(self) -> int:
        """Bytes of masters and optimizer state held by this rank."""
        n = 0
        for e in self.all_entries():
            if e.master is not None:
                n += e.master.numel() * e.master.element_size()
            if self.local is not None:
                for v in self.local.state.get(e.opt, {}).values():
                    if isinstance(v, torch.Tensor):
                        n += v.numel() * v.element_size()
        return n

    # ------------------------------------------------------------------ step
    def step(
        self, param_groups: Sequence[dict[str, Any]], unused: Set[tuple[int, int]] = frozenset()
    ) -> None:
        """One local step on the reduced gradients; see the module docstring.

        ``unused``: ``(bucket index, position)`` of the params no rank used since the last
        step; they are skipped (see [Note: Per-param fragments]).
        """
        local = self.local
        if local is None:
            self.factors.clear()
            return
        for wg, lg in zip(param_groups, local.param_groups, strict=True):
            lg.update(hyperparams(wg))
        try:
            for e in self.all_entries():
                if (
                    e.bucket.grad_fresh
                    or e.bucket.grad_shard is None
                    or (e.bucket.index, e.position) in unused
                ):
                    e.opt.grad = None
                    continue
                g = e.grad()
                if e.master is not None:
                    mg = g.to(e.master.dtype)
                    for f in self.factors:  # one multiply each, in order
                        mg.mul_(f.to(device=mg.device, dtype=mg.dtype))
                    e.master.grad = mg
                else:
                    e.tensor.grad = g
            local.step()
            with torch.no_grad():
                for e in self.all_entries():
                    if e.master is not None and e.master.grad is not None:
                        e.tensor.copy_(e.master)
                    e.opt.grad = None
        finally:
            self.factors.clear()
        for wg, lg in zip(param_groups, local.param_groups, strict=True):
            wg.update(hyperparams(lg))

    # ------------------------------------------------------------------ loss scaling
    def has_master(self, b: _Bucket) -> bool:
        """Whether the bucket's tensors are stepped through masters (another dtype)."""
        return self.master_dtype is not None and b.dtype != self.master_dtype

    def unscale(
        self, buckets: Sequence[_Bucket], inv_scale: torch.Tensor
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
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for b in buckets:
                shard = b.grad_shard
                if b.grad_fresh or shard is None:
                    continue
                flag = found.setdefault(
                    b.device, torch.zeros((), dtype=torch.float32, device=b.device)
                )
                if not self.has_master(b):
                    shard.mul_(inv_scale.to(device=shard.device, dtype=shard.dtype))
                flag.copy_(torch.maximum(flag, (~torch.isfinite(shard).all()).to(flag.dtype)))
        if self.master_dtype is not None:
            self.factors.append(inv_scale.detach().to(dtype=torch.float32).reshape(()).clone())
        return found

    # ------------------------------------------------------------------ clipping
    # Clipping by the global norm of the reduced gradients (fp32, over every rank's shard) is
    # ``ShardedDataParallel._clip_units``: the local norms of one or more steppers, one
    # all-reduce, then ``apply_clip`` on each. Padding elements of a shard hold zero gradients
    # (see [Note: Staging and launch order]), so they add nothing to the norm. Shards with
    # masters count times the pending factors (the loss scaler's ``1/scale`` after
    # ``unscale_``), as the step will use them.
    def local_norm(
        self, buckets: Sequence[_Bucket], norm_type: float, device: torch.device
    ) -> torch.Tensor:
        """The ``norm_type`` norm (fp32) of this rank's live reduced gradients in ``buckets``."""
        live = [b for b in buckets if not b.grad_fresh and b.grad_shard is not None]
        if not live:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = [torch.linalg.vector_norm(self._scaled(b), norm_type) for b in live]
        total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        return total.to(device)

    def apply_clip(self, buckets: Sequence[_Bucket], coef: torch.Tensor) -> None:
        """Multiplies the live shards by ``coef`` (queued as a factor for shards with masters,
        applied in fp32 to the upcast gradient at the step)."""
        for b in buckets:
            shard = b.grad_shard
            if b.grad_fresh or shard is None or self.has_master(b):
                continue
            shard.mul_(coef.to(device=shard.device, dtype=shard.dtype))
        if self.master_dtype is not None:
            self.factors.append(coef.detach().reshape(()).clone())

    def _scaled(self, b: _Bucket) -> torch.Tensor:
        """The bucket's reduced grad shard in fp32, times the pending factors (the loss
        scaler's ``1/scale``) when its tensors have masters: what the step will use."""
        shard = b.grad_shard
        assert shard is not None  # callers keep live buckets only
        g = shard.float()
        if self.has_master(b) and self.factors:
            g = g.clone() if g is shard else g
            for f in self.factors:
                g.mul_(f.to(device=g.device, dtype=g.dtype))
        return g
