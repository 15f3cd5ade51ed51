"""The flat, owner-contiguous bucket layout of ``ShardedDataParallel``.

[Note: Owner-contiguous buckets]
Every trainable param lives in exactly one bucket; a bucket holds params of one param group,
one dtype and one device, planned by ``shardkit.buckets.plan_buckets`` (reverse registration
order, size-capped, so bucket 0 fills first in backward). A bucket's flat buffer has
``numel = N * S`` elements (``N`` the world size) and rank ``r`` owns the contiguous range
``[r*S, (r+1)*S)``. The model's params are views of the buffer (``p.data`` is re-pointed), so:

- reduce-scattering the bucket's staged gradients hands rank ``r`` exactly the gradient of the
  elements it owns, and
- all-gathering every rank's range rebuilds every param of the bucket,

each of them one collective moving ``(N-1)/N`` of the buffer per rank: the two together move
exactly what DDP's all-reduce of the same bucket moves (``2(N-1)/N``).

Two kinds of buckets, by the param group's optimizer (see :func:`is_elementwise`):

- *fragment* buckets (element-wise optimizers: SGD, Adam, AdamW, Adagrad, ...): params are
  packed back to back and the buffer is padded at the end to a multiple of ``N``; a param may
  straddle two owners. The owner's optimizer steps its range as one flat tensor, which for an
  element-wise update is the same arithmetic as stepping each param. Padding is below ``N``
  elements per bucket.
- *whole-param* buckets (anything else: Muon orthogonalises a whole matrix, so an element range
  of it cannot be stepped alone): the bucket's params are assigned to ranks with
  ``shardkit.partition.partition`` and rank ``r``'s params are packed in ``[r*S, (r+1)*S)``,
  ``S`` the largest rank's share; the owner steps its params themselves (views of the buffer),
  exactly as a plain optimizer would. Padding is the imbalance of the assignment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from shardkit.buckets import plan_buckets
from shardkit.partition import partition
from torch.optim import Optimizer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "is_elementwise"]

ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
    )
    if hasattr(torch.optim, name)
)
"""torch optimizers whose update of an element depends only on that element's value, gradient
and state (plus scalar hyper-parameters and step counts): they may step any flat range of the
params. Subclasses are not included (a subclass may change that); pass ``elementwise=True``."""


def is_elementwise(optim_cls: type[Optimizer], override: bool | None) -> bool:
    """Whether params of ``optim_cls`` may be sharded element by element.

    ``override`` (the ``elementwise`` argument) wins when not ``None``; otherwise exact members
    of :data:`ELEMENTWISE_OPTIMIZERS` are element-wise and everything else is stepped by whole
    params.
    """
    if override is not None:
        return override
    return optim_cls in ELEMENTWISE_OPTIMIZERS


@dataclass(eq=False)
class _Bucket:
    """One owner-contiguous bucket. See [Note: Owner-contiguous buckets]."""

    index: int
    group: int
    """Index of the param group (of the sharded optimizer) its params belong to."""
    elementwise: bool
    params: list[torch.Tensor]
    offsets: list[int]
    """Start element of each param in ``flat``."""
    owners: list[int]
    """Owner rank of each param (whole-param buckets; -1 for fragment buckets)."""
    shard: int
    """``S``: elements owned by each rank."""
    world: int
    flat: torch.Tensor
    """The param buffer, ``world * shard`` elements; params are views of it."""
    grad_shard: torch.Tensor | None = None
    """This rank's reduced gradient, ``shard`` elements (allocated on first reduction)."""
    grad_fresh: bool = True
    """Whether ``grad_shard`` holds no gradient yet since the last step / zero_grad."""
    pending: set[int] = field(default_factory=set)
    """Positions (in ``params``) whose gradient this backward has not staged yet."""
    used: set[int] = field(default_factory=set)
    """Positions of the params that staged a real gradient on this rank since the grad shard
    was last consumed (see [Note: Per-param fragments] in ``shardkit.ddp._stepper``)."""
    staging: torch.Tensor | None = None
    launched: bool = False
    work: object | None = None
    out: torch.Tensor | None = None
    """Where the in-flight reduce-scatter writes (``grad_shard`` or a temporary)."""
    add_out: bool = False
    """Whether the temporary ``out`` is added to ``grad_shard`` (else copied into it)."""

    @property
    def numel(self) -> int:
        """Elements of the (padded) flat buffer."""
        return self.shard * self.world

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def device(self) -> torch.device:
        return self.flat.device

    def range_of(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` owned by ``rank``."""
        return rank * self.shard, (rank + 1) * self.shard

    def owned_params(self, rank: int) -> list[tuple[int, torch.Tensor]]:
        """(position, param) of the params ``rank`` owns (whole-param buckets)."""
        return [(i, p) for i, p in enumerate(self.params) if self.owners[i] == rank]

    def reset_backward(self) -> None:
        self.pending = set(range(len(self.params)))
        self.launched = False


def build_buckets(
    param_groups: Sequence[dict[str, Any]],
    elementwise: Sequence[bool],
    world: int,
    cap_bytes: int,
    first_cap_bytes: int,
    first_index: int = 0,
) -> tuple[list[_Bucket], list[str]]:
    """Plans the buckets of every param group and re-points the params into their buffers.

    Returns the buckets (in launch order: by group, then plan order; indices from
    ``first_index``) and one fingerprint string per group, for the cross-rank check.
    """
    buckets: list[_Bucket] = []
    prints: list[str] = []
    for gi, g in enumerate(param_groups):
        params = [p for p in g["params"] if isinstance(p, torch.Tensor) and p.requires_grad]
        if not params:
            prints.append("empty")
            continue
        plan = plan_buckets(
            params,
            cap_bytes,
            first_cap_bytes,
            pad_to_multiple=world if elementwise[gi] else 1,
        )
        prints.append(plan.fingerprint())
        for spec in plan.buckets:
            ps = [params[i] for i in spec.indices]
            if elementwise[gi]:
                offsets = list(spec.offsets)
                owners = [-1] * len(ps)
                shard = spec.padded_numel // world
            else:
                offsets, owners, shard = _whole_param_layout(ps, world)
            flat = torch.zeros(shard * world, dtype=spec.dtype, device=spec.device)
            with torch.no_grad():
                for p, off in zip(ps, offsets, strict=True):
                    view = flat[off : off + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view
            b = _Bucket(
                first_index + len(buckets),
                gi,
                elementwise[gi],
                ps,
                offsets,
                owners,
                shard,
                world,
                flat,
            )
            b.reset_backward()
            buckets.append(b)
    return buckets, prints


def _whole_param_layout(params: list[torch.Tensor], world: int) -> tuple[list[int], list[int], int]:
    """Offsets, owners and shard size of a whole-param bucket (largest rank share)."""
    part = partition(params, world, algorithm="sorted_greedy")
    owners = [0] * len(params)
    loads = [0] * world
    for r in range(world):
        for i in part.params_of(r):
            owners[i] = r
            loads[r] += params[i].numel()
    shard = max(max(loads), 1)
    offsets = [0] * len(params)
    fill = [r * shard for r in range(world)]
    for i, p in enumerate(params):
        offsets[i] = fill[owners[i]]
        fill[owners[i]] += p.numel()
    return offsets, owners, shard
