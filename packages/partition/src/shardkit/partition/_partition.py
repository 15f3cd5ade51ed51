"""Whole-parameter partitions: :func:`partition` and its result, :class:`Partition`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from shardkit.partition import _algorithms, _balanced
from shardkit.partition._format import _human, _imbalance, _table
from shardkit.partition._spec import (
    ParamSpec,
    _as_specs,
    _check_costs,
    _check_world_size,
    _default_costs,
)

__all__ = ["ALGORITHMS", "Partition", "partition"]

_Algorithm = Callable[[Sequence[float], int, Sequence[int] | None], list[int]]

_IMPLS: dict[str, _Algorithm] = {
    "greedy": _algorithms.greedy,
    "sorted_greedy": _algorithms.sorted_greedy,
    "balanced": _balanced.balanced,
}

ALGORITHMS: tuple[str, ...] = tuple(_IMPLS)
"""Names accepted by :func:`partition`'s ``algorithm``."""


@dataclass(frozen=True)
class Partition:
    """Which rank owns each (whole) parameter, and what that costs each rank.

    Identical on every rank for identical inputs (see [Note: Tie-breaking] in
    ``_algorithms.py``); compare across ranks with ``check_consistent``.
    """

    algorithm: str
    """Name of the algorithm that produced the assignment (one of :data:`ALGORITHMS`)."""
    world_size: int
    """Number of ranks."""
    assignment: tuple[int, ...]
    """Owning rank of each parameter, by parameter index (registration order)."""
    loads: tuple[float, ...]
    """Sum of the costs owned by each rank (exactly rounded)."""
    imbalance: float
    """``max(loads) / mean(loads)``: 1.0 is perfect; 1.0 as well when every cost is 0."""
    costs: tuple[float, ...] = ()
    """Cost of each parameter used for balancing (empty if not recorded)."""
    specs: tuple[ParamSpec, ...] = ()
    """Description of each parameter (empty if not recorded)."""
    unit: str = "bytes"
    """Unit of :attr:`costs` and :attr:`loads`: ``"bytes"`` (default cost model) or ``"cost"``."""
    _by_rank: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"Partition.world_size must be an int, got {self.world_size!r}")
        if len(self.loads) != self.world_size:
            raise ValueError(
                f"Partition.loads has {len(self.loads)} entries for world_size "
                f"{self.world_size}; expected one load per rank"
            )
        for name, seq in (("costs", self.costs), ("specs", self.specs)):
            if seq and len(seq) != len(self.assignment):
                raise ValueError(
                    f"Partition.{name} has {len(seq)} entries but assignment has "
                    f"{len(self.assignment)}; expected one per parameter or none"
                )
        assignment = self.assignment
        if assignment and (
            not all(type(r) is int for r in assignment)
            or min(assignment) < 0
            or max(assignment) >= self.world_size
        ):
            i, r = next(
                (i, r)
                for i, r in enumerate(assignment)
                if type(r) is not int or not 0 <= r < self.world_size
            )
            raise ValueError(
                f"Partition.assignment[{i}] = {r!r} is not a rank in [0, {self.world_size})"
            )
        by_rank: list[list[int]] = [[] for _ in range(self.world_size)]
        for i, r in enumerate(assignment):
            by_rank[r].append(i)
        object.__setattr__(self, "_by_rank", tuple(tuple(v) for v in by_rank))

    @property
    def num_params(self) -> int:
        """Number of parameters assigned."""
        return len(self.assignment)

    @property
    def lower_bound(self) -> float:
        """Lower bound on the maximum load of any whole-parameter plan of these costs.

        ``max(largest cost, mean load)``, in the unit of :attr:`loads`: a parameter cannot be
        split, and some rank carries at least the mean, so ``max(loads) / lower_bound`` is an
        upper bound on how far this plan is above the optimum. Not always reachable: six equal
        parameters on four ranks cannot do better than 2 / 1.5, and many identical transformer
        weights can leave the best plan a few percent above it (ViT-L/16 at 16 ranks: 1.046;
        see the README's "Optimality"). ``nan`` if costs were not recorded.
        """
        if not self.costs:
            return math.nan
        return max(max(self.costs), math.fsum(self.costs) / self.world_size)

    @property
    def bound(self) -> float:
        """:attr:`lower_bound` relative to the mean load: a floor for :attr:`imbalance`.

        ``max(1, largest cost / mean load)``; 1.0 when every cost is 0, ``nan`` if costs were
        not recorded.
        """
        if not self.costs:
            return math.nan
        total = math.fsum(self.costs)
        if total <= 0:
            return 1.0
        return max(1.0, max(self.costs) * self.world_size / total)

    def params_of(self, rank: int) -> tuple[int, ...]:
        """Indices of the parameters owned by ``rank``, ascending (registration order)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank must be an int in [0, {self.world_size}), got {type(rank).__name__} {rank!r}"
            )
        return self._by_rank[rank]

    def rank_of(self, index: int) -> int:
        """Owning rank of parameter ``index``."""
        n = len(self.assignment)
        if isinstance(index, bool) or not isinstance(index, int) or not -n <= index < n:
            raise IndexError(f"parameter index must be an int in [0, {n}), got {index!r}")
        return self.assignment[index]

    def split(self, params: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """The tensors of ``params`` owned by ``rank`` (``params`` in the partitioned order)."""
        if len(params) != len(self.assignment):
            raise ValueError(
                f"Partition.split got {len(params)} params but the partition covers "
                f"{len(self.assignment)}; pass the same parameters, in the same order"
            )
        return [params[i] for i in self.params_of(rank)]

    def describe(self) -> str:
        """A per-rank table (params, load, share, load / mean) and a summary line."""
        total = math.fsum(self.loads)
        mean = total / self.world_size
        rows = []
        for r in range(self.world_size):
            load = self.loads[r]
            rows.append(
                [
                    str(r),
                    str(len(self._by_rank[r])),
                    _human(load, self.unit),
                    f"{100 * load / total:.2f}%" if total > 0 else "-",
                    f"{load / mean:.4f}" if mean > 0 else "-",
                ]
            )
        head = (
            f"Partition(algorithm={self.algorithm!r}, world_size={self.world_size}, "
            f"params={self.num_params}, total={_human(total, self.unit)})"
        )
        summary = f"imbalance (max/mean): {self.imbalance:.4f}"
        if self.costs:
            bound = self.lower_bound
            gap = max(self.loads) / bound if bound > 0 else 1.0
            summary += (
                f"   lower bound max(largest param, mean): {_human(bound, self.unit)} "
                f"({self.bound:.4f} x mean)   max load / lower bound: {gap:.4f}"
            )
        return "\n".join(
            [head, _table(["rank", "params", "load", "share", "load/mean"], rows), summary]
        )


def partition(
    params: Iterable[torch.Tensor | ParamSpec],
    world_size: int,
    *,
    algorithm: str = "sorted_greedy",
    costs: Sequence[float] | None = None,
    group_sizes: Sequence[int] | None = None,
    unit: str | None = None,
) -> Partition:
    """Assign each whole parameter to one of ``world_size`` ranks, balancing the costs.

    Args:
        params: Tensors or :class:`ParamSpec`, in the same order on every rank.
        world_size: Number of ranks (>= 1); more ranks than parameters leaves ranks empty.
        algorithm: ``"greedy"`` (registration order to the least-loaded rank, fairscale
            OSS), ``"sorted_greedy"`` (largest first, torch ZeroRedundancyOptimizer) or
            ``"balanced"`` (LPT plus a budgeted local search of moves, swaps and subset-sum
            re-splits between ranks; never worse than ``sorted_greedy``, at most a few tens
            of ms). See :data:`ALGORITHMS`.
        costs: One non-negative cost per parameter. Default: :func:`param_costs` (trainable
            parameters cost their bytes, frozen ones 1).
        group_sizes: Lengths of consecutive optimizer param groups covering ``params``.
            ``sorted_greedy`` sorts within each group, carrying loads across groups, as
            torch's ZeroRedundancyOptimizer does; ``greedy`` and ``balanced`` are global.
        unit: Unit of the costs for :meth:`Partition.describe`: ``"bytes"`` (the default
            with default costs; also right for :func:`param_costs` output), ``"elements"``,
            or anything else for plain numbers (default with caller costs: ``"cost"``).

    Returns:
        The :class:`Partition`.

    Raises:
        TypeError: a wrongly typed argument.
        ValueError: empty ``params``, ``world_size`` < 1, unknown ``algorithm``, bad
            ``costs`` or ``group_sizes``.
    """
    world_size = _check_world_size(world_size, "partition")
    if not isinstance(algorithm, str) or algorithm not in _IMPLS:
        raise ValueError(
            f"partition: unknown algorithm {algorithm!r}; expected one of "
            f"{', '.join(map(repr, ALGORITHMS))}"
        )
    specs = _as_specs(params, "partition")
    if costs is None:
        cost_values = _default_costs(specs)
        unit = unit or "bytes"
    else:
        cost_values = _check_costs(costs, len(specs), "partition")
        unit = unit or "cost"
    groups = _check_group_sizes(group_sizes, len(specs))
    assignment = _IMPLS[algorithm](cost_values, world_size, groups)
    loads = _algorithms._loads(cost_values, assignment, world_size)  # noqa: SLF001 (same distribution)
    return Partition(
        algorithm=algorithm,
        world_size=world_size,
        assignment=tuple(assignment),
        loads=tuple(loads),
        imbalance=_imbalance(loads),
        costs=cost_values,
        specs=specs,
        unit=unit,
    )


def _check_group_sizes(group_sizes: Sequence[int] | None, n: int) -> tuple[int, ...] | None:
    if group_sizes is None:
        return None
    sizes = list(group_sizes)
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(
                f"partition: group_sizes must be non-negative ints, got {s!r} in {sizes!r}"
            )
    if sum(sizes) != n:
        raise ValueError(
            f"partition: group_sizes {sizes!r} sum to {sum(sizes)} but there are {n} "
            f"parameters; pass the length of every param group, in order"
        )
    return tuple(sizes)
