"""Whole-parameter partitions: invariants (hypothesis), documented tie-breaking, the result type."""

from __future__ import annotations

import itertools
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.partition import ALGORITHMS, ParamSpec, Partition, partition

_costs = st.lists(
    st.one_of(st.integers(0, 10**6).map(float), st.floats(0, 1e6, allow_nan=False)),
    min_size=1,
    max_size=40,
)
_world = st.integers(1, 9)


def _specs(n: int) -> list[ParamSpec]:
    return [ParamSpec((1,), torch.float32, True) for _ in range(n)]


@settings(max_examples=60, deadline=None)
@given(costs=_costs, world_size=_world, algorithm=st.sampled_from(ALGORITHMS))
def test_every_param_assigned_exactly_once(
    costs: list[float], world_size: int, algorithm: str
) -> None:
    p = partition(_specs(len(costs)), world_size, algorithm=algorithm, costs=costs)
    assert len(p.assignment) == len(costs)
    owned = sorted(i for r in range(world_size) for i in p.params_of(r))
    assert owned == list(range(len(costs)))
    for r in range(world_size):
        assert list(p.params_of(r)) == sorted(p.params_of(r))
        assert p.loads[r] == math.fsum(costs[i] for i in p.params_of(r))
    assert p.imbalance >= 1.0 - 1e-12
    assert p.imbalance <= world_size + 1e-9


@settings(max_examples=40, deadline=None)
@given(costs=_costs, world_size=_world, algorithm=st.sampled_from(ALGORITHMS))
def test_deterministic(costs: list[float], world_size: int, algorithm: str) -> None:
    a = partition(_specs(len(costs)), world_size, algorithm=algorithm, costs=costs)
    b = partition(_specs(len(costs)), world_size, algorithm=algorithm, costs=list(costs))
    assert a == b
    assert pickle.loads(pickle.dumps(a)) == a


@settings(max_examples=150, deadline=None)
@given(costs=_costs, world_size=st.integers(2, 9))
def test_balanced_never_worse_than_sorted_greedy(costs: list[float], world_size: int) -> None:
    lpt = partition(_specs(len(costs)), world_size, algorithm="sorted_greedy", costs=costs)
    bal = partition(_specs(len(costs)), world_size, algorithm="balanced", costs=costs)
    assert max(bal.loads) <= max(lpt.loads)
    assert bal.imbalance <= lpt.imbalance
    assert bal.imbalance >= bal.bound * (1 - 1e-12)


def _optimal_max(costs: list[int], k: int) -> int:
    best = sum(costs)
    for assign in itertools.product(range(k), repeat=len(costs)):
        loads = [0] * k
        for c, r in zip(costs, assign, strict=True):
            loads[r] += c
        best = min(best, max(loads))
    return best


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(st.integers(1, 60), min_size=2, max_size=9))
def test_balanced_is_optimal_on_small_two_rank_instances(costs: list[int]) -> None:
    # With 2 ranks the pair re-split is a (trimmed) subset-sum search over everything, which
    # solves these small integer instances exactly; LPT does not (see the next test). With 3+
    # ranks balanced is not always optimal (only never worse than LPT): see the README.
    bal = partition(_specs(len(costs)), 2, algorithm="balanced", costs=costs)
    assert max(bal.loads) == _optimal_max(costs, 2)


def test_balanced_beats_lpt_on_classic_instance() -> None:
    # LPT's worst case for 2 machines: {3, 3, 2, 2, 2} -> LPT 7/5, optimum 6/6.
    costs = [3, 3, 2, 2, 2]
    lpt = partition(_specs(5), 2, algorithm="sorted_greedy", costs=costs)
    bal = partition(_specs(5), 2, algorithm="balanced", costs=costs)
    assert sorted(lpt.loads) == [5.0, 7.0]
    assert bal.loads == (6.0, 6.0) and bal.imbalance == 1.0


def test_greedy_tie_breaking_is_documented_order() -> None:
    # Registration order, least-loaded rank, lowest rank on ties.
    p = partition(_specs(6), 3, algorithm="greedy", costs=[5, 5, 5, 1, 1, 1])
    assert p.assignment == (0, 1, 2, 0, 1, 2)
    p = partition(_specs(4), 2, algorithm="greedy", costs=[1, 3, 1, 1])
    assert p.assignment == (0, 1, 0, 0)


def test_sorted_greedy_is_stable_for_equal_costs() -> None:
    p = partition(_specs(5), 2, algorithm="sorted_greedy", costs=[2, 7, 2, 2, 7])
    # order: 1 (7) -> 0, 4 (7) -> 1, then 0, 2, 3 (2 each, registration order) -> 0, 1, 0
    assert p.assignment == (0, 0, 1, 0, 1)
    assert p.loads == (11.0, 9.0)


def test_group_sizes_sort_within_groups() -> None:
    costs = [1, 10, 4, 4]
    whole = partition(_specs(4), 2, algorithm="sorted_greedy", costs=costs)
    grouped = partition(_specs(4), 2, algorithm="sorted_greedy", costs=costs, group_sizes=[2, 2])
    # whole: 10->0, 4->1, 4->1, 1->1 ; grouped: [10->0, 1->1], then [4->1, 4->1]
    assert whole.assignment == (1, 0, 1, 1)
    assert grouped.assignment == (1, 0, 1, 1)
    grouped2 = partition(_specs(4), 2, algorithm="sorted_greedy", costs=[4, 1, 10, 4], group_sizes=[2, 2])
    assert grouped2.assignment == (0, 1, 1, 0)


def test_more_ranks_than_params_gives_empty_ranks() -> None:
    for algo in ALGORITHMS:
        p = partition(_specs(3), 5, algorithm=algo, costs=[3, 2, 1])
        assert sorted(p.assignment) == [0, 1, 2]
        assert [len(p.params_of(r)) for r in range(5)] == [1, 1, 1, 0, 0]
        assert p.loads[3:] == (0.0, 0.0)
        assert p.imbalance == pytest.approx(3 / (6 / 5))


def test_all_zero_costs() -> None:
    p = partition(_specs(4), 2, algorithm="balanced", costs=[0, 0, 0, 0])
    assert p.imbalance == 1.0 and p.bound == 1.0


def test_frozen_params_cost_almost_nothing() -> None:
    specs = [ParamSpec((1000,), torch.float32, True), ParamSpec((10**6,), torch.float32, False)]
    specs += [ParamSpec((1000,), torch.float32, True)]
    p = partition(specs, 2, algorithm="sorted_greedy")
    assert p.costs == (4000.0, 1.0, 4000.0)
    assert sorted(p.loads) == [4000.0, 4001.0]


def test_partition_result_api() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 50, 30, 20)]
    p = partition(params, 2, algorithm="balanced")
    assert isinstance(p, Partition)
    assert p.algorithm == "balanced" and p.world_size == 2 and p.unit == "bytes"
    assert p.loads == (400.0, 400.0) and p.imbalance == 1.0
    assert p.params_of(0) == (0,) and p.params_of(1) == (1, 2, 3)
    assert p.rank_of(2) == 1
    assert [t.numel() for t in p.split(params, 1)] == [50, 30, 20]
    text = p.describe()
    assert "rank" in text and "400 B" in text and "imbalance (max/mean): 1.0000" in text
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got int 2"):
        p.params_of(2)
    with pytest.raises(ValueError, match="same parameters"):
        p.split(params[:3], 0)
    with pytest.raises(dataclasses_frozen_error()):
        p.world_size = 3  # type: ignore[misc]


def dataclasses_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_partition_validates_direct_construction() -> None:
    with pytest.raises(ValueError, match="not a rank"):
        Partition("greedy", 2, (0, 2), (1.0, 1.0), 1.0)
    with pytest.raises(ValueError, match="one load per rank"):
        Partition("greedy", 2, (0, 1), (1.0,), 1.0)
