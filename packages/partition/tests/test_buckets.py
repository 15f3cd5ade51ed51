"""Bucket-level assignment for DDP overlap."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.partition import ParamSpec, partition, shard_buckets


def buckets_from_sizes(
    bucket_sizes: list[list[int]],
) -> tuple[list[list[int]], list[float]]:
    """Buckets given as lists of sizes -> (parameter indices per bucket, cost per index)."""
    buckets: list[list[int]] = []
    costs: list[float] = []
    for sizes in bucket_sizes:
        start = len(costs)
        costs.extend(float(x) for x in sizes)
        buckets.append(list(range(start, len(costs))))
    return buckets, costs


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=8), min_size=1, max_size=6),
    world_size=st.integers(1, 5),
    split=st.booleans(),
)
def test_every_bucketed_param_owned_once(
    sizes: list[list[int]], world_size: int, split: bool
) -> None:
    buckets, costs = buckets_from_sizes(sizes)
    bp = shard_buckets(buckets, world_size, costs=costs, split=split)
    assert all(r >= 0 for r in bp.assignment)
    owned = sorted(i for r in range(world_size) for i in bp.params_of(r))
    assert owned == list(range(len(costs)))
    for b, bucket in enumerate(bp.buckets):
        assert sorted(p for r in range(world_size) for p in bp.params_of(r, b)) == sorted(bucket)
        if not split:
            assert len(bp.ranks_of(b)) == 1
        for r in range(world_size):
            assert bp.bucket_loads[b][r] == math.fsum(costs[p] for p in bp.params_of(r, b))
    assert bp.loads == tuple(
        math.fsum(costs[p] for p in bp.params_of(r)) for r in range(world_size)
    )
    if split and sum(costs) > 0:
        # LPT-like guarantee: the most-loaded rank exceeds the least by at most one param.
        assert max(bp.loads) - min(bp.loads) <= max(costs) + 1e-9


def test_split_spreads_each_bucket() -> None:
    buckets, costs = buckets_from_sizes([[4, 4, 4, 4], [8, 8], [2, 2, 2, 2]])
    bp = shard_buckets(buckets, 2, costs=costs)
    assert [bp.ranks_of(b) for b in range(3)] == [(0, 1), (0, 1), (0, 1)]
    assert bp.loads == (20.0, 20.0) and bp.imbalance == 1.0
    whole = shard_buckets(buckets, 2, costs=costs, split=False)
    assert [len(whole.ranks_of(b)) for b in range(3)] == [1, 1, 1]
    assert whole.owners[0] == (0, 0, 0, 0)
    assert "bucket 0" in whole.describe()


def test_unbucketed_params_and_params_input() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 30)]
    params.append(torch.nn.Parameter(torch.zeros(5), requires_grad=False))
    bp = shard_buckets([[2, 1], [0]], 2, params=params)
    assert bp.assignment[3] == -1
    assert bp.unit == "bytes" and sum(bp.loads) == 240.0


def test_whole_buckets_match_partition_of_bucket_costs() -> None:
    buckets, costs = buckets_from_sizes([[5], [3, 3], [2, 2, 2], [4]])
    bp = shard_buckets(buckets, 2, costs=costs, split=False, algorithm="balanced")
    ref = partition([ParamSpec((), torch.float32)] * 4, 2, algorithm="balanced", costs=[5, 6, 6, 4])
    assert tuple(o[0] for o in bp.owners) == ref.assignment


def test_bucket_errors() -> None:
    with pytest.raises(ValueError, match="bucket 0 and bucket 1"):
        shard_buckets([[0, 1], [1]], 2, costs=[1, 1])
    with pytest.raises(ValueError, match=r"bucket 0 holds 5, not a parameter index in \[0, 2\)"):
        shard_buckets([[5]], 2, costs=[1, 1])
    with pytest.raises(TypeError, match=r"exactly one of costs= .* or params="):
        shard_buckets([[0]], 2)
    with pytest.raises(ValueError, match="no buckets"):
        shard_buckets([], 2, costs=[1])
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        shard_buckets([[0]], 0, costs=[1])
    with pytest.raises(ValueError, match="unknown algorithm"):
        shard_buckets([[0]], 2, costs=[1], algorithm="flat")
