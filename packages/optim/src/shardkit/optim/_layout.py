"""The owner of every parameter (the ZeRO-1 partition), by global index.

See [Note: Global parameter index] in ``shardkit.optim._state``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._agreement import agree_values, hyperparam_digest
from shardkit.optim._driver import ShardLayout
from shardkit.optim._state import global_params, group_ranges
from shardkit.partition import ALGORITHMS, partition

__all__: list[str] = []

_ALGORITHMS = tuple(ALGORITHMS)


def _check_algorithm(algorithm: Any) -> str:
    if not isinstance(algorithm, str) or algorithm not in _ALGORITHMS:
        raise ValueError(
            f"partition_algorithm must be one of {_ALGORITHMS}, got "
            f"{type(algorithm).__name__}: {algorithm!r}"
        )
    return algorithm


# [Note: Imposed partition]
# ``ShardedOptimizer.set_partition(owners, sync_order=...)`` lets a caller that knows better than
# the cost model (shardkit-overlap, which aligns owners with DDP's gradient buckets) impose the
# owner of every trainable param and the order in which params are laid out in the flat sync
# buffers. With ``sync_order`` listing DDP's buckets one after the other, the params of one
# (DDP bucket, owner) pair are contiguous in that owner's buffer, so syncing one DDP bucket is one
# broadcast per owner (see [Note: Exact sync spans]). The imposed partition is kept across
# rebuilds as long as the params and their ``requires_grad`` mask are unchanged; after any other
# change (``add_param_group``, freezing) the partition algorithm takes over again.


def _check_imposed(
    owners: Any, sync_order: Any, params: Sequence[torch.Tensor], world_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validates an imposed partition; returns ``(owners, order)`` as tuples of ints."""
    n = len(params)
    if isinstance(owners, (str, bytes)) or not isinstance(owners, Sequence):
        raise TypeError(
            f"owners must be a sequence of {n} group ranks (one per param, in global-index "
            f"order), got {type(owners).__name__}: {owners!r}"
        )
    if len(owners) != n:
        raise ValueError(
            f"owners has {len(owners)} entries but the optimizer holds {n} params: give one "
            f"group rank per param, in param-group order."
        )
    bad = [
        (i, o)
        for i, o in enumerate(owners)
        if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < world_size
    ]
    if bad:
        raise ValueError(
            f"owners must be ints in [0, {world_size}) (ranks of the optimizer's group); got "
            f"(global index, value) {bad[:5]}"
        )
    order: tuple[int, ...] = ()
    if sync_order is not None:
        if isinstance(sync_order, (str, bytes)) or not isinstance(sync_order, Sequence):
            raise TypeError(
                f"sync_order must be a sequence of global param indices or None, got "
                f"{type(sync_order).__name__}: {sync_order!r}"
            )
        seen: set[int] = set()
        for i in sync_order:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n or i in seen:
                raise ValueError(
                    f"sync_order must list distinct global param indices in [0, {n}); got "
                    f"{type(i).__name__}: {i!r} (repeated or out of range)"
                )
            seen.add(i)
        order = (*sync_order, *(i for i in range(n) if i not in seen))
    return tuple(int(o) for o in owners), order


def _build_layout(
    param_groups: Sequence[dict[str, Any]],
    world_size: int,
    algorithm: str,
    imposed: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> ShardLayout:
    """The partition: by ``algorithm``, or ``imposed`` ``(owners, order)`` when given."""
    params = global_params(param_groups)
    group_index = [gi for gi, ids in enumerate(group_ranges(param_groups)) for _ in ids]
    trainable = [bool(p.requires_grad) for p in params]
    if imposed is not None:
        return ShardLayout(
            tuple(params), tuple(group_index), imposed[0], tuple(trainable), imposed[1]
        )
    owner = [i % world_size for i in range(len(params))]
    train_idx = [i for i, t in enumerate(trainable) if t]
    if train_idx:
        plan = partition([params[i] for i in train_idx], world_size, algorithm=algorithm)
        for local, rank in enumerate(plan.assignment):
            owner[train_idx[local]] = int(rank)
    return ShardLayout(tuple(params), tuple(group_index), tuple(owner), tuple(trainable))


def agree_partition_inputs(
    params: Sequence[torch.Tensor],
    param_groups: Sequence[dict[str, Any]],
    group: dist.ProcessGroup,
    settings: tuple[str, bool, str, str],
) -> None:
    """Agrees on what a partition is built from, before it is built (collective): sparse
    params, ``settings`` (partition algorithm, broadcast_fp16, master dtype, optim class), the
    hyper-parameter digest, the group sizes and the ``requires_grad`` mask.

    Raises:
        ValueError: on every rank, when ranks differ, or when some param is not dense.
    """
    mask = bytes(int(p.requires_grad) for p in params)
    not_dense = [(i, p.layout) for i, p in enumerate(params) if p.layout != torch.strided]
    agree_values(
        (
            bool(not_dense),
            *settings,
            hyperparam_digest(param_groups),
            [len(g["params"]) for g in param_groups],
            hashlib.sha1(mask).hexdigest(),
        ),
        group,
        "(sparse params, partition_algorithm, broadcast_fp16, master_dtype, optim class, "
        "hyper-parameter digest, param group sizes, requires_grad mask hash)",
    )
    if not_dense:  # every rank agreed on this above, so every rank raises
        i, layout = not_dense[0]
        raise ValueError(
            f"ShardedOptimizer shards dense params only (they become views of flat buffers); "
            f"param {i} has layout {layout} ({len(not_dense)} such param(s)). Keep sparse params "
            f"in a separate, unsharded optimizer."
        )
