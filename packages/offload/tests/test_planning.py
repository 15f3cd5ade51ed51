"""Optimality and shape properties of the balanced slicing (single process)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.offload import balanced_slices, module_bytes
from torch import nn


def _brute_force_best(costs: list[int], k: int) -> int:
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=9), st.data())
def test_partition_is_optimal_and_well_formed(costs: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(costs)))
    slices = balanced_slices(costs, k)
    assert len(slices) == k
    assert all(len(r) >= 1 for r in slices)
    assert [i for r in slices for i in r] == list(range(len(costs)))
    assert all(r.step == 1 for r in slices)
    worst = max(sum(costs[i] for i in r) for r in slices)
    assert worst == _brute_force_best(costs, k)


def test_partition_beats_greedy_fill() -> None:
    # Greedy "close a slice before it exceeds the mean (12)" gives [7], [7, 1], [5, 9, 8]: 22.
    costs = [7, 7, 1, 5, 9, 8]
    slices = balanced_slices(costs, 3)
    assert max(sum(costs[i] for i in r) for r in slices) == _brute_force_best(costs, 3) == 15
    assert slices == [range(0, 2), range(2, 5), range(5, 6)]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=2, max_size=120), st.data())
def test_partition_large_inputs_cover_everything(costs: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, min(len(costs), 12)))
    slices = balanced_slices(costs, k)
    assert [i for r in slices for i in r] == list(range(len(costs)))
    assert len(slices) == k and all(len(r) for r in slices)
    # never worse than the trivial lower bounds' companion: the largest single item and mean
    worst = max(sum(costs[i] for i in r) for r in slices)
    assert worst >= max(costs) - 1e-6


@pytest.mark.parametrize(
    ("costs", "k", "exc", "match"),
    [
        ([1, 2], 0, ValueError, "between 1 and"),
        ([1, 2], 3, ValueError, "between 1 and"),
        ([1, 2], 1.5, TypeError, "must be an int"),
        ([1, -2], 1, ValueError, "finite and >= 0"),
        ([1, float("nan")], 1, ValueError, "finite and >= 0"),
    ],
)
def test_partition_bad_input(
    costs: list[float], k: object, exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        balanced_slices(costs, k)  # type: ignore[arg-type]


def test_module_bytes_counts_params_and_buffers_once() -> None:
    lin = nn.Linear(4, 3)  # 12 + 3 floats
    bn = nn.BatchNorm1d(3)  # 3 + 3 params, 3 + 3 float buffers, 1 int64
    seq = nn.Sequential(lin, bn, lin)
    assert module_bytes(lin) == 15 * 4
    assert module_bytes(bn) == 12 * 4 + 8
    assert module_bytes(seq) == 15 * 4 + 12 * 4 + 8
    assert module_bytes(nn.ReLU()) == 0
    assert torch.zeros(1).element_size() == 4
