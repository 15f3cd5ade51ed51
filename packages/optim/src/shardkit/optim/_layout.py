"""Global parameter numbering and the owner of every parameter (the ZeRO-1 partition)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from shardkit.partition import ALGORITHMS, partition

__all__: list[str] = []

_ALGORITHMS = tuple(ALGORITHMS)


# [Note: Global parameter index]
# A parameter's *global index* is its position when the wrapper's param groups are flattened in
# order, exactly as ``torch.optim.Optimizer.state_dict`` numbers them. It is the key of every
# state entry that leaves this package (consolidated dicts, DCP checkpoints), which is what makes
# those independent of the world size: any partition at any world size maps the same index to the
# same parameter. Owners are ranks of the optimizer's group (see [Note: Rank numbering]).
# Trainable parameters are partitioned by shardkit-partition; frozen ones are never stepped nor
# synchronised, and are given a round-robin owner only so that state they carried from a time they
# were trainable has a home.


@dataclass(frozen=True)
class _Layout:
    """Which rank owns which parameter.

    Attributes:
        params: every parameter of the wrapper, in global-index order.
        group_index: global index -> index of its param group.
        owner: global index -> owning rank (group numbering).
        trainable: global index -> ``requires_grad`` when the layout was built.
    """

    params: tuple[torch.Tensor, ...]
    group_index: tuple[int, ...]
    owner: tuple[int, ...]
    trainable: tuple[bool, ...]

    def owned(self, rank: int) -> list[int]:
        """Global indices owned by ``rank``, ascending."""
        return [i for i, r in enumerate(self.owner) if r == rank]

    def index_of(self) -> dict[int, int]:
        """``id(param) -> global index``."""
        return {id(p): i for i, p in enumerate(self.params)}


def _check_algorithm(algorithm: Any) -> str:
    if not isinstance(algorithm, str) or algorithm not in _ALGORITHMS:
        raise ValueError(
            f"partition_algorithm must be one of {_ALGORITHMS}, got "
            f"{type(algorithm).__name__}: {algorithm!r}"
        )
    return algorithm


def _build_layout(
    param_groups: Sequence[dict[str, Any]], world_size: int, algorithm: str
) -> _Layout:
    params: list[torch.Tensor] = []
    group_index: list[int] = []
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            params.append(p)
            group_index.append(gi)
    trainable = [bool(p.requires_grad) for p in params]
    owner = [i % world_size for i in range(len(params))]
    train_idx = [i for i, t in enumerate(trainable) if t]
    if train_idx:
        plan = partition([params[i] for i in train_idx], world_size, algorithm=algorithm)
        for local, rank in enumerate(plan.assignment):
            owner[train_idx[local]] = int(rank)
    return _Layout(tuple(params), tuple(group_index), tuple(owner), tuple(trainable))
