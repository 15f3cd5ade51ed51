"""The ``balanced`` algorithm on inputs dominated by repeated identical sizes (issue 15).

Targets: imbalance <= 1.01 on every shipped shape file at world 2 to 64 wherever the largest
parameter is at most half the mean load (except where no plan can reach it), never worse than
sorted_greedy, deterministic, fallbacks logged once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.partition import _algorithms, _balanced, available_shapes, load_shapes, param_costs

# (shape, world) pairs in scope (largest parameter at most half the mean load) where no
# whole-parameter plan reaches imbalance 1.01. vit-l16: proven below by counting 1024x1024
# units (test_vit_l16_is_optimal_by_counting_units), world 29 by hand in that test's comment.
# The others: benchmarks/prove_bounds.py (an integer program over a relaxation, HiGHS; README
# "Optimality"). Facts about the shapes, not about any algorithm's output.
UNREACHABLE_1_01 = {
    "llama2-7b": {19, 21, 23},
    "mistral-7b": {23, 25},
    "mixtral-8x7b": {35, 45, 48, 51, 54, 55, 58, 59, 62, 63, 64},
    "vit-l16": {6, 7, 8, 9} | set(range(11, 37)),
}


def _imbalance(costs: list[float], owners: list[int], world: int) -> float:
    return max(_algorithms._loads(costs, owners, world)) / (math.fsum(costs) / world)


def _misses(name: str, algorithm: str) -> list[tuple[int, float]]:
    """(world, imbalance) for every in-scope world 2-64 where ``algorithm`` misses 1.01."""
    costs = param_costs(load_shapes(name).specs)
    run = _balanced.balanced if algorithm == "balanced" else _algorithms.sorted_greedy
    out = []
    for w in range(2, 65):
        if max(costs) > math.fsum(costs) / w / 2 or w in UNREACHABLE_1_01.get(name, set()):
            continue
        imb = _imbalance(costs, run(costs, w), w)
        if imb > 1.01:
            out.append((w, round(imb, 4)))
    return out


@pytest.mark.parametrize("name", sorted(available_shapes()))
def test_shipped_shapes_meet_the_balance_target(name: str) -> None:
    assert _misses(name, "balanced") == []
    costs = param_costs(load_shapes(name).specs)
    for w in range(2, 65):
        bal = _balanced.balanced(costs, w)
        lpt = _algorithms.sorted_greedy(costs, w)
        mean = math.fsum(costs) / w
        got = max(_algorithms._loads(costs, bal, w))
        assert got <= max(_algorithms._loads(costs, lpt, w)), (name, w)
        assert got >= max(max(costs), mean), (name, w)
        if w in UNREACHABLE_1_01.get(name, set()):
            # No plan reaches 1.01 there: a result at or below it would disprove the proof.
            assert max(costs) <= mean / 2 and got / mean > 1.01, (name, w)


def test_the_sweep_fails_on_lpt() -> None:
    # The sweep above is not vacuous: LPT (sorted_greedy; the issue reported ``balanced``
    # returning exactly its plans) misses the target on LLaMA-2-7B at 12 world sizes, among
    # them 16 (1.0183) where balanced reaches 1.0009.
    missed = {name: _misses(name, "sorted_greedy") for name in available_shapes()}
    assert [w for w, _ in missed["llama2-7b"]] == [10, 11, 12, 13, 15, 16, 17, 18, 20, 22, 24, 25]
    assert dict(missed["llama2-7b"])[16] == 1.0183


def _unit_bound(costs: list[float], world: int, unit: float) -> float:
    """A lower bound on the best maximum load, by counting ``unit``-multiples.

    Costs that are multiples of ``unit`` ("big") sum to ``B`` units; a rank whose other
    parameters cost ``s`` holds at most ``floor((C - s) / unit)`` big units under a cap
    ``C``. Placing only the three largest other parameters (the rest cost nothing, which can
    only help) in every possible grouping, the cap is infeasible when even the best grouping
    leaves room for fewer than ``B`` units. Returns the smallest candidate cap not refuted
    (caps change feasibility only where some ``C - s`` crosses a multiple of ``unit``).
    """
    big = round(math.fsum(c for c in costs if c > 0 and c % unit == 0) / unit)
    small = sorted((c for c in costs if c % unit != 0), reverse=True)[:3]
    groupings: list[list[float]] = [[]]
    for s in small:  # every set partition of the (up to) three, as its group sums
        groupings = [[*g[:i], g[i] + s, *g[i + 1 :]] for g in groupings for i in range(len(g))] + [
            [*g, s] for g in groupings
        ]
    groupings = [g for g in groupings if len(g) <= world]
    floor_ = max(max(costs), math.fsum(costs) / world)
    candidates = sorted(
        {floor_} | {j * unit + s for g in groupings for s in [0.0, *g] for j in range(big + 1)}
    )
    for cap in candidates:
        if cap < floor_:
            continue
        room = max(
            sum(math.floor((cap - s) / unit) for s in g) + (world - len(g)) * math.floor(cap / unit)
            for g in groupings
            if all(s <= cap for s in g)
        )
        if room >= big:
            return cap
    raise AssertionError("no candidate cap")


def test_vit_l16_is_optimal_by_counting_units() -> None:
    # The issue's example. ViT-L/16's block weights (qkv 3072x1024, proj 1024x1024, fc1 and
    # fc2 4096x1024) are 3, 1, 4 and 4 units of 1024x1024 fp32; the rest is the head (1000x1024,
    # 0.98 units), the patch embedding (0.75), the position embedding (0.19) and small vectors.
    # At 16 ranks the 288 units fill every rank to exactly 18, so the head's rank carries
    # 18.98 units against a mean of 18.14: every plan is >= 1.046 x mean and the ~1.005 split
    # the issue hoped for does not exist; at 32 ranks likewise >= 1.0999. balanced meets these
    # bounds at every world from 2 to 36 (the target's scope) but 29, where the count of each
    # size matters: 48 4-unit weights on 29 ranks put two on >= 19 ranks, each then holding
    # 8, 9 or 10 units with two 1-unit weights to reach 10, while the 2 units of slack
    # (29 x 10 - 288) allow at most two ranks below 10; 17 x 2 > 24 1-unit weights, so some
    # rank holds >= 11 units = 1.0991 x mean, balanced's result.
    costs = param_costs(load_shapes("vit-l16").specs)
    unit = 1024 * 1024 * 4.0
    for w in range(2, 37):
        got = max(_algorithms._loads(costs, _balanced.balanced(costs, w), w))
        mean = math.fsum(costs) / w
        if w == 29:
            assert got == 11 * unit
            continue
        bound = _unit_bound(costs, w, unit)
        assert bound <= got <= bound * (1 + 1e-4), (w, got / mean, bound / mean)
        if w in (16, 32):
            assert bound / mean > (1.046 if w == 16 else 1.0999)
        assert (bound / mean > 1.01) == (w in UNREACHABLE_1_01["vit-l16"]), w


def test_fallbacks_are_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_balanced, "_logged", set())
    rng = random.Random(1)
    costs = [float(rng.randint(1, 10**9)) for _ in range(400)]  # exhausts the work budget
    with caplog.at_level(logging.INFO, logger="shardkit.partition"):
        first = _balanced.balanced(costs, 16)
        assert _balanced.balanced(costs, 16) == first
        _balanced.balanced(costs[::-1], 16)
    records = [r for r in caplog.records if r.name == "shardkit.partition"]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert "work budget" in message and "400 params, 16 ranks" in message
    assert "never worse than sorted_greedy" in message
    # Where LPT is already at the bound nothing falls back and nothing is logged.
    monkeypatch.setattr(_balanced, "_logged", set())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardkit.partition"):
        _balanced.balanced([1.0] * 64, 8)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


# Few distinct sizes, each repeated many times, plus a few odd ones: the regime.
_repeated = st.lists(
    st.tuples(st.integers(1, 5000), st.integers(1, 60)), min_size=1, max_size=5
).flatmap(
    lambda runs: st.permutations([float(c) for c, n in runs for _ in range(n)]).map(list)
) | st.lists(st.integers(1, 10**6).map(float), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(costs=_repeated, world=st.integers(2, 64))
def test_balanced_never_worse_than_sorted_greedy_on_repeated_sizes(
    costs: list[float], world: int
) -> None:
    bal = _balanced.balanced(costs, world)
    lpt = _algorithms.sorted_greedy(costs, world)
    got = max(_algorithms._loads(costs, bal, world))
    assert got <= max(_algorithms._loads(costs, lpt, world))
    assert got >= max(max(costs), math.fsum(costs) / world) * (1 - 1e-12)
    assert sorted(set(bal)) == sorted(set(bal) & set(range(world)))
    assert _balanced.balanced(costs, world) == bal


_SCRIPT = """
import json, random, sys
from shardkit.partition import _balanced, load_shapes, param_costs
rng = random.Random(3)
uniform = [float(rng.randint(1, 10**6)) for _ in range(3000)]
vit = param_costs(load_shapes("vit-l16").specs)
print(json.dumps([_balanced.balanced(vit, 16), _balanced.balanced(uniform, 24)]))
"""


def test_balanced_is_identical_across_processes() -> None:
    # Every rank computes its plan alone: no clock, no hash order, no shared state may change
    # the result. Another interpreter, with another hash seed, must agree with this one.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, check=True
    )
    rng = random.Random(3)
    uniform = [float(rng.randint(1, 10**6)) for _ in range(3000)]
    vit = param_costs(load_shapes("vit-l16").specs)
    assert json.loads(run.stdout) == [_balanced.balanced(vit, 16), _balanced.balanced(uniform, 24)]


@pytest.mark.parametrize(
    ("name", "worlds"), [("llama2-7b", (5, 9, 13, 17, 22)), ("vit-l16", (17, 23, 33))]
)
def test_balanced_budget_is_not_the_limit_on_shapes(name: str, worlds: tuple[int, ...]) -> None:
    # The work budget is a stand-in for a time limit; on real shapes the search ends because
    # no step helps, not because the budget ran out: 30x the budget finds nothing better.
    costs = param_costs(load_shapes(name).specs)
    for w in worlds:
        got = _balanced.balanced(costs, w)
        notes: set[str] = set()
        more, _ = _balanced._improve(
            costs, _algorithms.sorted_greedy(costs, w), w, 30 * _balanced._MAX_IMPROVE_WORK, notes
        )
        assert max(_algorithms._loads(costs, got, w)) <= max(_algorithms._loads(costs, more, w))
