"""Bucket-level assignment for overlapping the optimizer step with DDP's gradient buckets."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from shardkit.partition._algorithms import _loads
from shardkit.partition._format import _human, _imbalance, _table
from shardkit.partition._partition import ALGORITHMS, partition
from shardkit.partition._spec import (
    ParamSpec,
    _as_specs,
    _check_costs,
    _check_world_size,
    _default_costs,
)

__all__ = ["BucketPartition", "shard_buckets"]


@dataclass(frozen=True)
class BucketPartition:
    """For each gradient bucket, which rank owns (and steps) each of its parameters.

    # [Note: Bucket sharding]
    # With ``split=False`` whole buckets go to ranks (balanced over bucket costs with a
    # :func:`partition` algorithm): when a bucket's all-reduce finishes only its owner steps,
    # as torch's ddp_zero_hook does with shard_buckets=False. With ``split=True`` every
    # bucket is split at parameter boundaries across ranks: its parameters, largest first
    # (stable), each go to the rank with the smallest running load, the loads carried over
    # from the buckets before it (in bucket order). Each bucket is thus spread over the
    # ranks (every rank has work as soon as any bucket is ready) and the global loads stay
    # within one parameter of each other, like sorted_greedy.
    """

    world_size: int
    """Number of ranks."""
    split: bool
    """Whether buckets were split across ranks (else each bucket has one owner)."""
    buckets: tuple[tuple[int, ...], ...]
    """Parameter indices of each bucket, as given."""
    owners: tuple[tuple[int, ...], ...]
    """Owning rank of each entry of :attr:`buckets` (same nesting)."""
    assignment: tuple[int, ...]
    """Owning rank by parameter index; -1 for parameters in no bucket."""
    bucket_loads: tuple[tuple[float, ...], ...]
    """Cost owned by each rank within each bucket: ``bucket_loads[b][rank]``."""
    loads: tuple[float, ...]
    """Total cost owned by each rank."""
    imbalance: float
    """``max(loads) / mean(loads)``."""
    unit: str = "bytes"
    """Unit of the loads: ``"bytes"`` (default cost model) or ``"cost"``."""
    _by_rank: tuple[tuple[int, ...], ...] = field(
        init=False, repr=False, compare=False, default=()
    )

    def __post_init__(self) -> None:
        by_rank: list[list[int]] = [[] for _ in range(self.world_size)]
        for i, r in enumerate(self.assignment):
            if r >= 0:
                by_rank[r].append(i)
        object.__setattr__(self, "_by_rank", tuple(tuple(v) for v in by_rank))

    def params_of(self, rank: int, bucket: int | None = None) -> tuple[int, ...]:
        """Parameter indices owned by ``rank`` (ascending), optionally within one bucket
        (then in bucket order)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        if bucket is None:
            return self._by_rank[rank]
        return tuple(
            p for p, r in zip(self.buckets[bucket], self.owners[bucket], strict=True) if r == rank
        )

    def ranks_of(self, bucket: int) -> tuple[int, ...]:
        """Ranks owning at least one parameter of ``bucket``, ascending."""
        return tuple(sorted(set(self.owners[bucket])))

    def describe(self) -> str:
        """Per-bucket owners and the per-rank load table."""
        total = math.fsum(self.loads)
        mean = total / self.world_size
        rows = [
            [
                str(r),
                str(len(self._by_rank[r])),
                _human(self.loads[r], self.unit),
                f"{self.loads[r] / mean:.4f}" if mean > 0 else "-",
            ]
            for r in range(self.world_size)
        ]
        lines = [
            f"BucketPartition(world_size={self.world_size}, split={self.split}, "
            f"buckets={len(self.buckets)})"
        ]
        for b in range(len(self.buckets)):
            lines.append(
                f"  bucket {b}: {len(self.buckets[b])} params, ranks {list(self.ranks_of(b))}"
            )
        lines.append(_table(["rank", "params", "load", "load/mean"], rows))
        lines.append(f"imbalance (max/mean): {self.imbalance:.4f}")
        return "\n".join(lines)


def shard_buckets(
    buckets: Sequence[Sequence[int]],
    world_size: int,
    *,
    costs: Sequence[float] | None = None,
    params: Iterable[torch.Tensor | ParamSpec] | None = None,
    split: bool = True,
    algorithm: str = "sorted_greedy",
) -> BucketPartition:
    """Assign the parameters of DDP-style gradient buckets to ranks. See [Note: Bucket sharding].

    Args:
        buckets: Parameter indices of each bucket, e.g. from ``DistributedDataParallel``'s
            bucket order. A parameter may appear in at most one bucket; parameters in no
            bucket (frozen ones, usually) are left unassigned (-1).
        costs: Cost per parameter index. Give either ``costs`` or ``params`` (whose default
            cost model is :func:`param_costs`).
        world_size: Number of ranks (>= 1).
        params: Tensors or :class:`ParamSpec` indexed by the bucket entries.
        split: Split buckets at parameter boundaries across ranks (default) or assign whole
            buckets.
        algorithm: With ``split=False``, the :func:`partition` algorithm over bucket costs.

    Raises:
        TypeError / ValueError: missing or conflicting costs, an index out of range or in two
            buckets, ``world_size`` < 1, an unknown algorithm.
    """
    world_size = _check_world_size(world_size, "shard_buckets")
    if (costs is None) == (params is None):
        raise TypeError(
            "shard_buckets: pass exactly one of costs= (a cost per parameter index) or "
            "params= (tensors / ParamSpec, costed by param_costs)"
        )
    if params is not None:
        cost_values = _default_costs(_as_specs(params, "shard_buckets"))
        unit = "bytes"
    else:
        given = list(costs or ())
        cost_values = _check_costs(given, len(given), "shard_buckets")
        unit = "cost"
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(
            f"shard_buckets: unknown algorithm {algorithm!r}; expected one of "
            f"{', '.join(map(repr, ALGORITHMS))}"
        )
    n = len(cost_values)
    norm: list[tuple[int, ...]] = []
    where: dict[int, int] = {}
    for b, bucket in enumerate(buckets):
        entries = tuple(bucket)
        for p in entries:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < n:
                raise ValueError(
                    f"shard_buckets: bucket {b} holds {p!r}, not a parameter index in "
                    f"[0, {n})"
                )
            if p in where:
                raise ValueError(
                    f"shard_buckets: parameter {p} is in bucket {where[p]} and bucket {b}; "
                    f"each parameter may be in one bucket only"
                )
            where[p] = b
        norm.append(entries)
    if not norm:
        raise ValueError("shard_buckets: got no buckets; pass at least one list of indices")

    assignment = [-1] * n
    owners: list[tuple[int, ...]] = []
    if split:
        heap = [(0.0, r) for r in range(world_size)]
        for entries in norm:
            order = sorted(range(len(entries)), key=lambda j: cost_values[entries[j]], reverse=True)
            own = [0] * len(entries)
            for j in order:
                load, r = heap[0]
                own[j] = r
                heapq.heapreplace(heap, (load + cost_values[entries[j]], r))
            owners.append(tuple(own))
    else:
        bucket_costs = [math.fsum(cost_values[p] for p in e) for e in norm]
        whole = partition(
            [ParamSpec((), torch.float32) for _ in norm],
            world_size,
            algorithm=algorithm,
            costs=bucket_costs,
        )
        owners.extend(tuple(whole.assignment[b] for _ in e) for b, e in enumerate(norm))
    bucket_loads: list[tuple[float, ...]] = []
    for entries, owned in zip(norm, owners, strict=True):
        for p, r in zip(entries, owned, strict=True):
            assignment[p] = r
        bucket_loads.append(tuple(_loads([cost_values[p] for p in entries], owned, world_size)))
    flat_idx = [p for p in range(n) if assignment[p] >= 0]
    loads = _loads([cost_values[p] for p in flat_idx], [assignment[p] for p in flat_idx], world_size)
    return BucketPartition(
        world_size=world_size,
        split=split,
        buckets=tuple(norm),
        owners=tuple(owners),
        assignment=tuple(assignment),
        bucket_loads=tuple(bucket_loads),
        loads=tuple(loads),
        imbalance=_imbalance(loads),
        unit=unit,
    )
