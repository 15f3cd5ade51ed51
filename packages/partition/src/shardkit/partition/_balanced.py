"""The ``balanced`` whole-parameter algorithm: LPT, then a budgeted local search.

Deterministic like every balancer (see [Note: Tie-breaking] in ``_algorithms.py``): the same
``costs`` and ``world_size`` give the same assignment on every rank, with no communication and
no clock (the search is bounded by counted work, never by elapsed time).
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
from bisect import bisect_left
from collections.abc import Sequence

from shardkit.partition._algorithms import _karmarkar_karp, _loads, sorted_greedy

__all__: list[str] = []

_log = logging.getLogger("shardkit.partition")
_logged: set[str] = set()
_logged_lock = threading.Lock()

# Karmarkar-Karp costs O(n * k log k) Python operations; past this many item-rank products the
# search starts from LPT alone. A pure function of (n, k), so determinism is unaffected.
_KK_MAX_WORK = 4_096
# Bound on local-search steps (each strictly improves the sorted load vector).
_MAX_IMPROVE_STEPS = 2_000
# The search stops once the maximum load is within this relative distance of the lower bound:
# a millionth of a rank's memory is below anything an allocator can observe.
_REL_TOL = 1e-6
# Pair re-splitting (2-way differencing of two ranks' items) is skipped past this many items.
_MAX_PAIR_ITEMS = 2_048
# Subset-sum re-splitting is tried up to this many pseudo-items (equal costs grouped, see
# ``_pseudo_items``) and this many (trimmed) reachable sums.
_MAX_SUBSET_ITEMS = 256
_MAX_SUBSET_STATES = 4_096
# Total work of one search (items scanned by move/swap searches, copied or sorted, states
# extended by subset sums, ranks ordered per step): a deterministic stand-in for a time limit.
# One unit is about one Python-level item operation; 40,000 of them take about 10-25 ms of
# CPython, which with the O(n log n) set-up keeps 10,000 params well under the 50 ms target
# (benchmarks/bench_partition.py, README).
_MAX_IMPROVE_WORK = 40_000


def _fallback_once(reason: str, message: str, *args: object) -> None:
    """Logs ``message`` the first time this process meets ``reason`` (see [Note: Balanced])."""
    with _logged_lock:
        if reason in _logged:
            return
        _logged.add(reason)
    _log.info(message, *args)


# [Note: Balanced]
# ``balanced`` is never worse than sorted_greedy (LPT) on the same input:
# 1. run LPT; if its maximum is within _REL_TOL of the lower bound max(largest cost, mean),
#    it is optimal: return it;
# 2. while n * k is small (_KK_MAX_WORK), also run Karmarkar-Karp differencing (better than
#    LPT with few items per rank) and start from the one with the smaller maximum (LPT on
#    ties);
# 3. local search on the lowest-numbered most-loaded rank M, against lighter ranks T from
#    least to most loaded (smallest rank first on equal loads):
#    a. the single move or 1-for-1 swap between M and T that brings the pair closest to
#       equal (first T that has an improving one);
#    b. if no move or swap helps anywhere, re-split the union of M's and T's items: a
#       trimmed subset-sum search over the union with equal costs grouped (``_subset_near``),
#       or 2-way differencing when the union is too large; applied if the pair's new maximum
#       is below M's load (first T, from the lightest, where it is). This finds many-for-many
#       exchanges (one 90 MB MLP weight for three 33 MB attention weights);
#    c. if no pair helps, M and the two lightest ranks are re-balanced as a 3-rank
#       sub-problem (differencing, then steps a-b on those three), applied if all three end
#       below M's load.
#    Each step lowers M's load strictly and leaves the others below M's old load, so the
#    sorted load vector decreases lexicographically and the loop terminates. It stops at the
#    lower bound (within _REL_TOL), when no step helps, or when the counted work budget
#    (_MAX_IMPROVE_WORK, _MAX_IMPROVE_STEPS) is spent: never on a clock, so every rank stops
#    at the same step;
# 4. a final guard compares fsum-exact maxima against LPT and returns LPT if rounding ever
#    made the result worse, so the guarantee holds bit-for-bit on the reported loads;
# 5. every fallback (budget or step limit reached, a re-split skipped for size, the guard)
#    is logged once per process (INFO, "shardkit.partition"), with how far the plan ended
#    from the lower bound. The result never depends on whether it was logged.
# Why local search and not exact methods: inputs dominated by repeated identical sizes are
# where LPT's greedy choice goes wrong, and where moves, swaps and re-splits of equal-cost
# runs (``_pseudo_items``) fix it cheaply. On ViT-L/16 the result is provably optimal at
# every world size from 2 to 36 (tests: counting 1024x1024 units); where a shipped shape
# ends above 1.01, benchmarks/prove_bounds.py (an integer program) shows that no plan
# reaches 1.01 (README, "Optimality").
def balanced(
    costs: Sequence[float], world_size: int, group_sizes: Sequence[int] | None = None
) -> list[int]:
    """See [Note: Balanced]. ``group_sizes`` is ignored: balance is global."""
    del group_sizes
    lpt = sorted_greedy(costs, world_size)
    if world_size == 1 or not costs:
        return lpt
    lpt_max = max(_loads(costs, lpt, world_size))
    bound = max(max(costs), math.fsum(costs) / world_size)
    if lpt_max <= bound * (1 + _REL_TOL):
        return lpt  # at the lower bound already (largest parameter or the mean)
    start = lpt
    if len(costs) * world_size <= _KK_MAX_WORK:
        kk = _karmarkar_karp(costs, world_size)
        if max(_loads(costs, kk, world_size)) < lpt_max:
            start = kk
    notes: set[str] = set()
    improved, left = _improve(costs, start, world_size, _MAX_IMPROVE_WORK, notes)
    best_max = max(_loads(costs, improved, world_size))
    if best_max > lpt_max:
        notes.add("guard")
        improved, best_max = lpt, lpt_max
    gap = best_max / bound if bound > 0 else 1.0
    for reason in sorted(notes):
        _fallback_once(
            reason,
            "partition: algorithm='balanced' on %d params, %d ranks: %s; the plan is %.4f x "
            "the lower bound max(largest param, mean) (LPT: %.4f), never worse than "
            "sorted_greedy. Logged once per process.",
            len(costs),
            world_size,
            _FALLBACKS[reason],
            gap,
            lpt_max / bound if bound > 0 else 1.0,
        )
    _log.debug(
        "balanced: %d params, %d ranks: LPT max/bound %.6f -> %.6f, work %d of %d",
        len(costs),
        world_size,
        lpt_max / bound if bound > 0 else 1.0,
        gap,
        _MAX_IMPROVE_WORK - left,
        _MAX_IMPROVE_WORK,
    )
    return improved


# What each fallback recorded by the search means (the reasons ``_fallback_once`` logs).
_FALLBACKS = {
    "budget": "the local search stopped on its work budget (_MAX_IMPROVE_WORK) before reaching "
    "a local optimum",
    "steps": "the local search stopped after _MAX_IMPROVE_STEPS improving steps",
    "pair": "two-rank re-splits were skipped for rank pairs holding more than "
    "_MAX_PAIR_ITEMS params",
    "triple": "the three-rank re-split was skipped (more than _MAX_SUBSET_ITEMS params on the "
    "three ranks)",
    "guard": "rounding made the searched plan worse than LPT's, so LPT's plan was returned",
}


def _best_step(
    src_costs: list[float], dst_costs: list[float], gap: float
) -> tuple[float, int, int] | None:
    """Best move (dst pos -1) or 1-for-1 swap from a bin to one ``gap`` lighter.

    Moving ``d`` from the heavy bin to the light one leaves the pair's larger load at
    ``top - min(d, gap - d)``, so the best ``d`` is the one closest to ``gap / 2`` with
    ``0 < d < gap``. Returns ``(|d - gap/2|, src pos, dst pos)`` or None.
    """
    half = gap / 2
    best: tuple[float, int, int] | None = None
    j = bisect_left(src_costs, half)
    for pos in (j - 1, j):
        if 0 <= pos < len(src_costs):
            d = src_costs[pos]
            if 0 < d < gap:
                cand = (abs(d - half), pos, -1)
                if best is None or cand < best:
                    best = cand
    if not dst_costs:
        return best
    last_x = math.nan
    for pos, x in enumerate(src_costs):
        if x == last_x:
            continue  # same cost as the previous item: same candidates, keep the first
        last_x = x
        q = bisect_left(dst_costs, x - half)
        for qpos in (q - 1, q):
            if 0 <= qpos < len(dst_costs):
                d = x - dst_costs[qpos]
                if 0 < d < gap:
                    cand = (abs(d - half), pos, qpos)
                    if best is None or cand < best:
                        best = cand
        if best is not None and best[0] == 0.0:
            break
    return best


def _two_way(costs: list[float]) -> list[int]:
    """Karmarkar-Karp 2-way differencing of ``costs`` (sorted ascending).

    Returns a side (0 or 1) per item. Node ids below ``len(costs)`` are items; node
    ``m + j`` is the difference of ``same[j]`` (kept on the node's side) and ``other[j]``
    (moved to the opposite side).
    """
    m = len(costs)
    same: list[int] = []
    other: list[int] = []
    heap = [(-c, j) for j, c in enumerate(costs)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, na = heapq.heappop(heap)
        b, nb = heapq.heappop(heap)
        node = m + len(same)
        same.append(na)
        other.append(nb)
        heapq.heappush(heap, (a - b, node))  # -(|a| - |b|)
    side = [0] * m
    nodes = [heap[0][1]]
    sides = [0]
    while nodes:
        node, s = nodes.pop(), sides.pop()
        if node < m:
            side[node] = s
        else:
            nodes += (same[node - m], other[node - m])
            sides += (s, 1 - s)
    return side


def _pseudo_items(costs: list[float]) -> list[tuple[float, int, int]]:
    """Group runs of equal cost in ``costs`` (sorted) into binary-split pseudo-items.

    A run of ``m`` equal costs ``c`` becomes pseudo-items of 1, 2, 4, ... copies (the last
    one takes the remainder), so any count 0..m is a subset of them and ``m`` identical
    parameters cost ``log2(m)`` subset-sum rounds instead of ``m``. Returns ``(cost sum,
    position of the run's first item, copies)``; zero costs are left out (they never matter).
    """
    out: list[tuple[float, int, int]] = []
    j = 0
    n = len(costs)
    while j < n:
        c = costs[j]
        end = j + 1
        while end < n and costs[end] == c:
            end += 1
        if c > 0:
            left, copies = end - j, 1
            while left > 0:
                take = min(copies, left)
                out.append((c * take, j, take))
                left -= take
                copies *= 2
        j = end
    return out


def _subset_near(
    costs: list[float], target: float, grain: float, limit: int
) -> tuple[list[int] | None, int]:
    """Positions of a subset of ``costs`` (sorted) whose sum is near and at most ``target``.

    Dynamic programme over reachable sums of the pseudo-items (``_pseudo_items``), trimmed
    to one sum per ``grain``-wide cell (the first sum to reach a cell keeps it, with a
    back-pointer to the previous state and the pseudo-item added), so the result is within
    about ``grain`` per pseudo-item of the best subset. Within a run of equal costs the
    chosen copies are the run's first positions. Returns ``(positions, work done)``; the
    positions are None past ``_MAX_SUBSET_ITEMS`` pseudo-items, ``_MAX_SUBSET_STATES`` cells
    or ``limit`` work.
    """
    pseudo = _pseudo_items(costs)
    work = len(costs)
    if len(pseudo) > _MAX_SUBSET_ITEMS:
        return None, work
    # [Note: Allocation-free search] The search keeps its state in flat lists of ints and
    # floats (bins as index lists, DP states as parallel lists, cells as an int -> int dict),
    # never in a tuple per item or state: those are objects the cyclic garbage collector
    # tracks, allocating thousands of them triggered collections mid-search, and with torch
    # imported one full collection costs tens of ms, more than the whole search budget.
    prev: list[int] = [-1]
    added_by: list[int] = [-1]
    sums: list[float] = [0.0]
    cell_taken: dict[int, int] = {0: 0}
    for j, (c, _, _) in enumerate(pseudo):
        count = len(sums)
        for state in range(count):
            ns = sums[state] + c
            if ns > target:
                continue
            cell = int(ns / grain) + 1
            if cell not in cell_taken:
                cell_taken[cell] = len(sums)
                prev.append(state)
                added_by.append(j)
                sums.append(ns)
        work += count
        if len(sums) > _MAX_SUBSET_STATES or work > limit:
            return None, work
    # One state per cell, so equal sums cannot tie: the first maximum is the only one.
    best = max(range(len(sums)), key=sums.__getitem__)
    copies: dict[int, int] = {}
    while best != 0:
        _, start, take = pseudo[added_by[best]]
        copies[start] = copies.get(start, 0) + take
        best = prev[best]
    chosen = [start + q for start, count in sorted(copies.items()) for q in range(count)]
    return chosen, work


class _Bins:
    """Each rank's items as index and cost lists sorted by (cost, index), and its load.

    See [Note: Allocation-free search]: parallel lists, no tuple per item.
    """

    def __init__(self, costs: Sequence[float], assignment: Sequence[int], k: int) -> None:
        self.costs = costs
        self.idx: list[list[int]] = [[] for _ in range(k)]
        # Stable sort of the indices by cost: (cost, index) order, no key tuples.
        for i in sorted(range(len(costs)), key=costs.__getitem__):
            self.idx[assignment[i]].append(i)
        self.cst = [[costs[i] for i in ids] for ids in self.idx]
        self.loads = [math.fsum(c) for c in self.cst]

    def set(self, r: int, ids: list[int]) -> None:
        """Gives rank ``r`` the items ``ids`` (sorted by (cost, index))."""
        self.idx[r] = ids
        self.cst[r] = [self.costs[i] for i in ids]
        self.loads[r] = math.fsum(self.cst[r])

    def take(self, r: int, pos: int) -> int:
        """Removes and returns the item at position ``pos`` of rank ``r``."""
        self.cst[r].pop(pos)
        return self.idx[r].pop(pos)

    def put(self, r: int, i: int) -> None:
        """Inserts item ``i`` into rank ``r`` at its (cost, index) position."""
        c = self.costs[i]
        ids, cs = self.idx[r], self.cst[r]
        pos = bisect_left(cs, c)
        while pos < len(cs) and cs[pos] == c and ids[pos] < i:
            pos += 1
        ids.insert(pos, i)
        cs.insert(pos, c)

    def union(self, ranks: Sequence[int]) -> list[int]:
        """The items of ``ranks`` together, sorted by (cost, index)."""
        ids: list[int] = []
        for r in ranks:
            ids += self.idx[r]
        ids.sort()
        ids.sort(key=self.costs.__getitem__)  # stable: ties stay in index order
        return ids


def _improve(
    costs: Sequence[float],
    assignment: list[int],
    world_size: int,
    budget: int,
    notes: set[str],
    triples: bool = True,
) -> tuple[list[int], int]:
    """Local search on the most-loaded rank; see [Note: Balanced], [Note: Tie-breaking].

    Returns the improved assignment and the work budget left; adds to ``notes`` the
    fallbacks met (keys of ``_FALLBACKS``). The O(n log n) set-up, like LPT's own sort, is
    not charged to ``budget``, which bounds the search steps only.
    """
    k = world_size
    if k == 1:
        return assignment, budget
    bins = _Bins(costs, assignment, k)
    loads = bins.loads
    lower = max(max(costs), math.fsum(costs) / k)
    good_enough = lower * (1 + _REL_TOL)
    for step in range(_MAX_IMPROVE_STEPS + 1):
        top = max(loads)
        m = loads.index(top)
        if top <= good_enough:
            break
        if budget <= 0:
            notes.add("budget")
            break
        if step == _MAX_IMPROVE_STEPS:
            notes.add("steps")
            break
        targets = [t for t in sorted(range(k), key=lambda r: (loads[r], r)) if loads[t] < top]
        budget -= 2 * k
        changed, budget = _move_or_swap(bins, m, targets, budget)
        if changed is None and budget > 0:
            changed, budget = _resplit_pair(bins, m, targets, budget, notes)
        if changed is None and triples and len(targets) >= 2 and budget > 0:
            changed, budget = _resplit_triple(bins, m, targets, budget, notes)
        if changed is None:
            if budget <= 0:
                notes.add("budget")
            break
        for r in changed:
            loads[r] = math.fsum(bins.cst[r])
            budget -= len(bins.cst[r])
    out = list(assignment)
    for r, ids in enumerate(bins.idx):
        for i in ids:
            out[i] = r
    return out, budget


def _move_or_swap(
    bins: _Bins, m: int, targets: list[int], budget: int
) -> tuple[list[int] | None, int]:
    """Step a of [Note: Balanced]: apply the first improving move or swap.

    Returns the changed ranks (None if no target has an improving step) and the budget left.
    """
    src_costs = bins.cst[m]
    top = bins.loads[m]
    for t in targets:
        if budget <= 0:
            break
        # A scan of src's costs with one bisection into dst per distinct cost.
        budget -= 2 + len(src_costs)
        best = _best_step(src_costs, bins.cst[t], top - bins.loads[t])
        if best is None:
            continue
        _, pos, qpos = best
        item = bins.take(m, pos)
        if qpos >= 0:
            bins.put(m, bins.take(t, qpos))
        bins.put(t, item)
        return [m, t], budget
    return None, budget


def _resplit_pair(
    bins: _Bins, m: int, targets: list[int], budget: int, notes: set[str]
) -> tuple[list[int] | None, int]:
    """Step b of [Note: Balanced]: re-split M with one light rank; changed ranks, budget."""
    top = bins.loads[m]
    for t in targets:
        if budget <= 0:
            break
        if len(bins.idx[m]) + len(bins.idx[t]) > _MAX_PAIR_ITEMS:
            notes.add("pair")
            continue
        union = bins.union((m, t))
        ucost = [bins.costs[i] for i in union]
        budget -= 3 * len(union)
        low = bins.loads[t]
        chosen, work = _subset_near(ucost, (top + low) / 2, (top - low) / 32, budget)
        budget -= work
        if chosen is not None:
            side = [0] * len(union)
            for j in chosen:
                side[j] = 1
        else:
            side = _two_way(ucost)
            budget -= 4 * len(union)
        a = [i for i, s in zip(union, side, strict=True) if s == 0]
        b = [i for i, s in zip(union, side, strict=True) if s == 1]
        load_a = math.fsum(bins.costs[i] for i in a)
        load_b = math.fsum(bins.costs[i] for i in b)
        if max(load_a, load_b) < top:
            bins.set(m, a)
            bins.set(t, b)
            return [m, t], budget
    return None, budget


def _resplit_triple(
    bins: _Bins, m: int, targets: list[int], budget: int, notes: set[str]
) -> tuple[list[int] | None, int]:
    """Step c of [Note: Balanced]: M and the two lightest ranks as a 3-rank sub-problem."""
    top = bins.loads[m]
    t1, t2 = targets[0], targets[1]
    if len(bins.idx[m]) + len(bins.idx[t1]) + len(bins.idx[t2]) > _MAX_SUBSET_ITEMS:
        notes.add("triple")
        return None, budget
    union = bins.union((m, t1, t2))
    sub_costs = [bins.costs[i] for i in union]
    budget -= 3 * len(union)
    sub_budget = min(budget, _MAX_IMPROVE_WORK // 8)
    sub, left = _improve(
        sub_costs,
        _karmarkar_karp(sub_costs, 3),
        3,
        sub_budget,
        set(),  # the sub-problem's own fallbacks are not the caller's: it only ever helps
        triples=False,
    )
    budget -= sub_budget - left
    parts: list[list[int]] = [[], [], []]
    for i, r in zip(union, sub, strict=True):
        parts[r].append(i)
    loads = [math.fsum(bins.costs[i] for i in part) for part in parts]
    if max(loads) < top:
        for r, part in zip((m, t1, t2), parts, strict=True):
            bins.set(r, part)
        return [m, t1, t2], budget
    return None, budget
