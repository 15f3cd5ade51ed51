"""Which rank steps which parameter: owners aligned with DDP's gradient buckets."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from shardkit.buckets import plan_buckets
from shardkit.optim import ShardedOptimizer
from shardkit.partition import shard_buckets
from torch.nn.parallel import DistributedDataParallel

__all__: list[str] = []

# DDP's reducer rebuilds its buckets with a 1 MiB first bucket (kDefaultFirstBucketBytes).
_DDP_FIRST_BUCKET_BYTES = 1024 * 1024


# [Note: Bucket-aligned ownership]
# Correctness never depends on how owners line up with DDP's buckets: the hooks step, for
# every bucket, the params of that bucket this rank owns (whatever the owner map is) and
# broadcast every param of the bucket from its owner. So any bucket layout works, including
# the single all-param bucket DDP uses in the first iteration and the layout it rebuilds
# afterwards; no iteration is skipped. Alignment only decides the balance: at registration the
# optimizer is repartitioned (one collective, state moved if any) so that owners follow the
# buckets DDP is expected to build (``plan_buckets`` with DDP's caps over the params in
# reverse registration order, i.e. the order backward usually produces gradients), split at
# param boundaries (``shard_buckets=True``) or whole buckets per rank (``False``), by
# shardkit-partition's ``shard_buckets``, through ``ShardedOptimizer.set_partition`` whose
# ``sync_order`` lays the flat broadcast buffers out bucket by bucket. If DDP ends up with
# another layout (its first iteration's single bucket, or a rebuild that differs from the plan),
# steps stay exact; only the balance and the number of broadcasts differ from the plan.


def _ddp_params(ddp: DistributedDataParallel) -> list[tuple[str, torch.nn.Parameter]]:
    """DDP's trainable, non-ignored params in registration order (shared params once)."""
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    return [
        (name, p)
        for name, p in ddp.module.named_parameters()
        if p.requires_grad and name not in ignored
    ]


def _planned_partition(
    ddp: DistributedDataParallel, zero: ShardedOptimizer, split: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Owner (group rank) of every param of ``zero`` (global index order), and the sync order.

    The sync order lists the params of the planned DDP buckets one bucket after the other, so
    that shardkit-optim lays its flat broadcast buffers out by DDP bucket: syncing one bucket is
    then one broadcast per owner. See [Note: Bucket-aligned ownership].
    """
    layout = zero.shard_layout
    index = layout.index_of()
    named = _ddp_params(ddp)
    cap = int(ddp.bucket_bytes_cap)
    plan = plan_buckets(named, cap, min(_DDP_FIRST_BUCKET_BYTES, cap))
    buckets = [[index[id(named[j][1])] for j in b] for b in plan.bucket_indices]
    assignment = shard_buckets(
        buckets, zero.world_size, params=list(layout.params), split=split
    ).assignment
    owners = tuple(
        int(a) if a >= 0 else int(o) for a, o in zip(assignment, layout.owner, strict=True)
    )
    return owners, tuple(i for b in buckets for i in b)


def _apply_partition(
    zero: ShardedOptimizer, partition: tuple[Sequence[int], Sequence[int]]
) -> None:
    """Imposes the planned owners and sync order on ``zero`` (moving any state). Collective."""
    owners, order = partition
    zero.set_partition(list(owners), sync_order=list(order))
