"""Prove, with an integer program, where no whole-parameter plan reaches an imbalance target.

Not a benchmark (pytest does not collect it) and not part of any test run: a developer tool
that needs HiGHS (``pip install highspy``), which no shardkit package depends on. Run from the
repo root:

    pip install highspy && python packages/partition/benchmarks/prove_bounds.py [--target 1.01]

For every shipped shape file and world size 2-64 where the largest parameter is at most half
the mean load (the issue's scope) and ``balanced`` ends above ``--target``, it asks HiGHS two
yes/no questions about a relaxation of the problem:

1. is there a plan with maximum load <= target * mean?
2. is there a plan 0.02% better than ``balanced``'s?

The relaxation: parameters costing at most ``tau * mean`` become fluid (splittable) and the
rest are packed whole, as counts per distinct size ("configurations": a rank's multiset of
sizes, so identical ranks cost nothing). Relaxing can only make plans easier, so "infeasible"
is a proof for the real problem. ``tau`` starts coarse (0.2: only the largest sizes whole) and
is refined to 0.004 while the answer stays "feasible"; the first "infeasible" is the proof.
The output ends with the ``(shape, world)`` pairs proven above the target, the list that
``tests/test_shapes_cli.py`` exempts from the target.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from collections.abc import Sequence

import highspy
import numpy as np
from shardkit.partition import available_shapes, load_shapes, param_costs, partition

_TAUS = (0.2, 0.05, 0.015, 0.004)
_MAX_CONFIGS = 60_000


def _configs(sizes: Sequence[float], counts: Sequence[int], cap: float) -> list[list[int]] | None:
    """Every count vector (one count per size, within ``counts``) whose sizes sum to <= cap."""
    out: list[list[int]] = []
    x = [0] * len(sizes)

    def dfs(t: int, cur: float) -> bool:
        if len(out) > _MAX_CONFIGS:
            return False
        if t == len(sizes):
            out.append(list(x))
            return True
        top = min(counts[t], int((cap - cur) // sizes[t]) + 1)
        for c in range(top, -1, -1):
            if cur + c * sizes[t] <= cap:
                x[t] = c
                if not dfs(t + 1, cur + c * sizes[t]):
                    return False
        x[t] = 0
        return True

    return out if dfs(0, 0.0) else None


def _feasible_at(
    costs: Sequence[float], k: int, cap: float, tau: float, seconds: float
) -> bool | None:
    """Can the parameters costing more than ``tau * mean`` be packed into k ranks of ``cap``?"""
    mean = math.fsum(costs) / k
    count = collections.Counter(c / mean for c in costs if c > tau * mean)
    sizes = sorted(count, reverse=True)
    counts = [count[s] for s in sizes]
    configs = _configs(sizes, counts, cap / mean)
    if configs is None:
        return None  # too many configurations at this tau
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", seconds)
    n = len(configs)
    cols = np.arange(n, dtype=np.int32)
    h.addVars(n, np.zeros(n), np.full(n, float(k)))
    h.changeColsIntegrality(n, cols, np.array([highspy.HighsVarType.kInteger] * n))
    h.addRow(0.0, float(k), n, cols, np.ones(n))  # at most k ranks
    a = np.array(configs, dtype=float)
    for t, want in enumerate(counts):  # every parameter of every size placed exactly once
        nz = np.nonzero(a[:, t])[0].astype(np.int32)
        h.addRow(float(want), float(want), len(nz), nz, a[nz, t])
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        return True
    if status == highspy.HighsModelStatus.kInfeasible:
        return False
    return None


def feasible(costs: Sequence[float], k: int, cap: float, seconds: float = 30.0) -> bool | None:
    """False: proven that no plan has maximum load <= cap. True/None: not proven."""
    if cap < math.fsum(costs) / k or cap < max(costs):
        return False
    answer: bool | None = None
    for tau in _TAUS:
        answer = _feasible_at(costs, k, cap, tau, seconds)
        if answer is False:
            return False
    return answer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=1.01)
    parser.add_argument("--shapes", nargs="*", default=list(available_shapes()))
    parser.add_argument("--seconds", type=float, default=30.0, help="HiGHS limit per question")
    args = parser.parse_args(argv)
    proven: dict[str, list[int]] = {}
    print("| model | world | sorted_greedy | balanced | target reachable | 0.02% better exists |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes:
        specs = load_shapes(name).specs
        costs = param_costs(specs)
        for k in range(2, 65):
            mean = math.fsum(costs) / k
            if max(costs) > mean / 2:
                continue
            bal = partition(specs, k, algorithm="balanced")
            if bal.imbalance <= args.target:
                continue
            lpt = partition(specs, k, algorithm="sorted_greedy")
            reach = feasible(costs, k, args.target * mean, args.seconds)
            better = feasible(costs, k, max(bal.loads) * (1 - 2e-4), args.seconds)
            words = {False: "no (proven)", True: "yes", None: "unknown (time limit)"}
            print(
                f"| {name} | {k} | {lpt.imbalance:.4f} | {bal.imbalance:.4f} | {words[reach]} "
                f"| {words[better]} |",
                flush=True,
            )
            if reach is False:
                proven.setdefault(name, []).append(k)
    print("\nproven above the target:", dict(proven))
    return 0


if __name__ == "__main__":
    sys.exit(main())
