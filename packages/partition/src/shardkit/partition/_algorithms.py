"""The whole-parameter balancers: pure functions from costs to an owning rank per parameter.

Every function here is deterministic: the same ``costs`` and ``world_size`` give the same
assignment on every rank, in every process, without communication.

# [Note: Tie-breaking]
# Every choice is made with a total order, so no hash, set or dict iteration order and no
# float summation order can change the result:
# - "least-loaded rank" means the smallest load, and among equal loads the smallest rank
#   (``sizes.index(min(sizes))`` in fairscale's OSS, ``_get_min_index`` in torch's
#   ZeroRedundancyOptimizer);
# - "largest first" is a stable sort by cost, descending, so equal costs keep registration
#   order (Python's ``sorted(..., reverse=True)`` is stable, as torch's ZeRO relies on);
# - in the differencing (Karmarkar-Karp) pass, equal partial solutions are ordered by the
#   index of the item that created them, and equal subset sums by subset position;
# - local improvement always works on the lowest-numbered most-loaded rank, tries target
#   ranks from least to most loaded (smallest rank first on equal load), and among equally
#   good moves or swaps takes the first found scanning items in (cost, index) order;
#   re-splits scan items in (cost, index) order and keep the first sum reaching each cell.
# Loads reported to users are ``math.fsum`` over each rank's costs: exactly rounded, hence
# independent of the order in which an algorithm happened to add them.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Sequence

__all__: list[str] = []

# Karmarkar-Karp costs O(n * k log k) Python operations; past this many item-rank products we
# start local improvement from LPT alone (which is then already within a small item of the
# bound, see [Note: Balanced]). A pure function of (n, k), so determinism is unaffected.
_KK_MAX_WORK = 16_384
# Bound on local-improvement steps (each strictly improves the sorted load vector).
_MAX_IMPROVE_STEPS = 2_000
# Local improvement stops once the maximum load is within this relative distance of the lower
# bound: a millionth of a rank's memory is below anything an allocator can observe.
_REL_TOL = 1e-6
# Pair re-splitting (2-way differencing of two ranks' items) is skipped past this many items.
_MAX_PAIR_ITEMS = 2_048
# Subset-sum pair re-splitting is tried up to this many items and (trimmed) reachable sums.
_MAX_SUBSET_ITEMS = 256
_MAX_SUBSET_STATES = 4_096
# Total work per call of local improvement (items scanned by swap searches, states extended
# by subset sums): a deterministic stand-in for a time limit (about 50 ms of CPython).
_MAX_IMPROVE_WORK = 300_000


def _segments(n: int, group_sizes: Sequence[int] | None) -> list[range]:
    if group_sizes is None:
        return [range(n)]
    out: list[range] = []
    start = 0
    for size in group_sizes:
        out.append(range(start, start + size))
        start += size
    return out


def greedy(costs: Sequence[float], world_size: int, group_sizes: Sequence[int] | None = None) -> list[int]:
    """Registration order, each parameter to the least-loaded rank (fairscale OSS).

    With ``group_sizes`` the parameters are consecutive groups; loads carry across groups,
    which is what fairscale does over optimizer param groups (and equals the ungrouped run).
    """
    del group_sizes  # registration order over all groups equals the per-group loop
    heap = [(0.0, r) for r in range(world_size)]
    out = [0] * len(costs)
    for i, c in enumerate(costs):
        load, r = heap[0]
        out[i] = r
        heapq.heapreplace(heap, (load + c, r))
    return out


def sorted_greedy(
    costs: Sequence[float], world_size: int, group_sizes: Sequence[int] | None = None
) -> list[int]:
    """Largest first (per group), each to the least-loaded rank (LPT; torch ZeRO semantics)."""
    heap = [(0.0, r) for r in range(world_size)]
    out = [0] * len(costs)
    for seg in _segments(len(costs), group_sizes):
        for i in sorted(seg, key=costs.__getitem__, reverse=True):
            load, r = heap[0]
            out[i] = r
            heapq.heapreplace(heap, (load + costs[i], r))
    return out


def _karmarkar_karp(costs: Sequence[float], world_size: int) -> list[int]:
    """Multiway largest differencing method (Karmarkar-Karp, Korf's k-way generalisation).

    Each partial solution is ``world_size`` subsets with their sums, sorted by sum descending.
    The two partial solutions with the largest spread (max - min) are combined by joining the
    largest subset of one with the smallest of the other, and so on, which cancels the
    spreads against each other. Subsets are nodes of a join forest kept in two flat int
    lists (no nested containers, so the garbage collector has nothing to traverse): node
    ids below n are items, node ``n + j`` joins ``left[j]`` and ``right[j]``; -1 is empty.
    """
    k = world_size
    n = len(costs)
    left: list[int] = []
    right: list[int] = []
    heap: list[tuple[float, int, list[float], list[int]]] = []
    pad_sums = [0.0] * (k - 1)
    pad_nodes = [-1] * (k - 1)
    for i in range(n):
        c = costs[i]
        heap.append((-c, i, [c, *pad_sums], [i, *pad_nodes]))
    heapq.heapify(heap)
    tiebreak = n
    order = range(k)
    while len(heap) > 1:
        _, _, sa, ba = heapq.heappop(heap)
        _, _, sb, bb = heapq.heappop(heap)
        sums = [sa[j] + sb[k - 1 - j] for j in order]
        nodes: list[int] = []
        for j in order:
            a, b = ba[j], bb[k - 1 - j]
            if a < 0:
                nodes.append(b)
            elif b < 0:
                nodes.append(a)
            else:
                nodes.append(n + len(left))
                left.append(a)
                right.append(b)
        # Stable sort by sum descending: equal sums keep subset position (see Note).
        perm = sorted(order, key=sums.__getitem__, reverse=True)
        sums = [sums[j] for j in perm]
        nodes = [nodes[j] for j in perm]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tiebreak, sums, nodes))
        tiebreak += 1
    out = [0] * n
    _, _, _, roots = heap[0]
    # Rank r gets the r-th largest subset, like LPT's first pick.
    for rank, root in enumerate(roots):
        stack = [root] if root >= 0 else []
        while stack:
            node = stack.pop()
            if node < n:
                out[node] = rank
            else:
                stack.append(left[node - n])
                stack.append(right[node - n])
    return out


def _loads(costs: Sequence[float], assignment: Sequence[int], world_size: int) -> list[float]:
    per_rank: list[list[float]] = [[] for _ in range(world_size)]
    for i, r in enumerate(assignment):
        per_rank[r].append(costs[i])
    return [math.fsum(v) for v in per_rank]


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


def _two_way(items: list[tuple[float, int]]) -> list[int]:
    """Karmarkar-Karp 2-way differencing of ``items`` (sorted (cost, index) pairs).

    Returns a side (0 or 1) per item. Node ids below ``len(items)`` are items; node
    ``m + j`` is the difference of ``same[j]`` (kept on the node's side) and ``other[j]``
    (moved to the opposite side).
    """
    m = len(items)
    same: list[int] = []
    other: list[int] = []
    heap = [(-c, j) for j, (c, _) in enumerate(items)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, na = heapq.heappop(heap)
        b, nb = heapq.heappop(heap)
        node = m + len(same)
        same.append(na)
        other.append(nb)
        heapq.heappush(heap, (a - b, node))  # -(|a| - |b|)
    side = [0] * m
    stack = [(heap[0][1], 0)]
    while stack:
        node, s = stack.pop()
        if node < m:
            side[node] = s
        else:
            stack.append((same[node - m], s))
            stack.append((other[node - m], 1 - s))
    return side


def _subset_near(
    items: list[tuple[float, int]], target: float, grain: float
) -> tuple[list[int], int] | None:
    """Positions of a subset of ``items`` whose cost sum is near and at most ``target``.

    Dynamic programme over reachable sums, trimmed to one sum per ``grain``-wide cell (the
    first sum to reach a cell keeps it, with a back-pointer to the previous cell and the
    item added), so the result is within about ``grain`` per item of the best subset.
    Returns ``(positions, work done)``, or None past ``_MAX_SUBSET_STATES`` cells.
    """
    back: dict[int, tuple[int, int, float]] = {0: (0, -1, 0.0)}
    frontier = [0]
    work = 0
    for j, (c, _) in enumerate(items):
        if c <= 0:
            continue
        added = []
        for key in frontier:
            ns = back[key][2] + c
            if ns > target:
                continue
            nk = int(ns / grain) + 1
            if nk not in back:
                back[nk] = (key, j, ns)
                added.append(nk)
        work += len(frontier)
        frontier.extend(added)
        if len(frontier) > _MAX_SUBSET_STATES:
            return None
    best = max(frontier, key=lambda key: (back[key][2], -key))
    chosen: list[int] = []
    while best != 0:
        prev, j, _ = back[best]
        chosen.append(j)
        best = prev
    return chosen, work


def _improve(
    costs: Sequence[float],
    assignment: list[int],
    world_size: int,
    budget: int = _MAX_IMPROVE_WORK,
    triples: bool = True,
) -> list[int]:
    """Local improvement of the most-loaded rank; see [Note: Balanced], [Note: Tie-breaking]."""
    k = world_size
    if k == 1:
        return assignment
    bins: list[list[tuple[float, int]]] = [[] for _ in range(k)]
    for i, r in enumerate(assignment):
        bins[r].append((costs[i], i))
    for b in bins:
        b.sort()
    loads = [math.fsum(c for c, _ in b) for b in bins]
    lower = max(max(costs), math.fsum(costs) / k)
    good_enough = lower * (1 + _REL_TOL)
    for _ in range(_MAX_IMPROVE_STEPS):
        top = max(loads)
        m = loads.index(top)
        if top <= good_enough or budget <= 0:
            break
        src = bins[m]
        src_costs = [c for c, _ in src]
        targets = [t for t in sorted(range(k), key=lambda r: (loads[r], r)) if loads[t] < top]
        applied = False
        changed = [m]
        for t in targets:
            dst = bins[t]
            best = _best_step(src_costs, [c for c, _ in dst], top - loads[t])
            budget -= len(src) + len(dst)
            if best is None:
                continue
            _, pos, qpos = best
            item = src.pop(pos)
            if qpos >= 0:
                insort(src, dst.pop(qpos))
            insort(dst, item)
            applied = True
            changed.append(t)
            break
        if not applied:
            # No single move or swap helps: re-split the union of the heavy bin and a lighter
            # one by 2-way differencing, which finds many-for-many exchanges.
            for t in targets:
                union = sorted(src + bins[t])
                if len(union) > _MAX_PAIR_ITEMS:
                    continue
                side = _two_way(union)
                budget -= len(union)
                half = (top + loads[t]) / 2
                if len(union) <= _MAX_SUBSET_ITEMS and budget > 0:
                    found = _subset_near(union, half, (top - loads[t]) / 32)
                    if found is not None:
                        chosen, work = found
                        budget -= work
                        side = [0] * len(union)
                        for j in chosen:
                            side[j] = 1
                a = [it for it, s in zip(union, side, strict=True) if s == 0]
                b = [it for it, s in zip(union, side, strict=True) if s == 1]
                if max(math.fsum(c for c, _ in a), math.fsum(c for c, _ in b)) < top:
                    bins[m], bins[t] = a, b
                    applied = True
                    changed.append(t)
                    break
        if not applied and triples and len(targets) >= 2 and budget > 0:
            # No pair helps: re-balance the heavy rank with the two lightest as a 3-rank
            # sub-problem (differencing, then this same search without triples).
            t1, t2 = targets[0], targets[1]
            union = sorted(src + bins[t1] + bins[t2])
            if len(union) <= _MAX_SUBSET_ITEMS:
                sub_costs = [c for c, _ in union]
                sub_budget = min(budget, _MAX_IMPROVE_WORK // 8)
                budget -= sub_budget + len(union) * 3
                sub = _improve(
                    sub_costs, _karmarkar_karp(sub_costs, 3), 3, sub_budget, triples=False
                )
                parts: list[list[tuple[float, int]]] = [[], [], []]
                for it, r in zip(union, sub, strict=True):
                    parts[r].append(it)
                if max(math.fsum(c for c, _ in part) for part in parts) < top:
                    bins[m], bins[t1], bins[t2] = parts
                    applied = True
                    changed += [t1, t2]
        if not applied:
            break
        for r in changed:
            loads[r] = math.fsum(c for c, _ in bins[r])
    out = list(assignment)
    for r, b in enumerate(bins):
        for _, i in b:
            out[i] = r
    return out


# [Note: Balanced]
# The "balanced" algorithm is never worse than sorted_greedy (LPT) on the same input:
# 1. run LPT; if its maximum is the largest cost, it is optimal: return it;
# 2. while n * k is small enough to be cheap (_KK_MAX_WORK), also run Karmarkar-Karp
#    differencing (much better than LPT with few items per rank) and keep the one with the
#    smaller maximum load (LPT on ties);
# 3. local improvement on the lowest-numbered most-loaded rank M, against lighter ranks T
#    from least to most loaded:
#    a. the single move or 1-for-1 swap between M and T that brings the pair closest to
#       equal (first T that has an improving one);
#    b. if no move or swap helps anywhere, re-split the union of M's and T's items: 2-way
#       differencing, replaced by a trimmed subset-sum search (``_subset_near``) when the
#       union is small; applied if the pair's new maximum is below M's load. This finds
#       many-for-many exchanges (one 90 MB MLP weight for three 33 MB attention weights);
#    c. if no pair helps, M and the two lightest ranks are re-balanced as a 3-rank
#       sub-problem (differencing, then steps a-b on those three), applied if all three end
#       below M's load.
#    Each step lowers M's load strictly and leaves the others below M's old load, so the sorted load
#    vector decreases lexicographically and the loop terminates. It stops at the lower bound
#    max(largest cost, total / k) (within _REL_TOL), when no step helps, or when the
#    deterministic work budget (_MAX_IMPROVE_WORK, _MAX_IMPROVE_STEPS) is spent;
# 4. a final guard compares fsum-exact maxima against LPT and returns LPT if rounding ever
#    made the result worse, so the guarantee holds bit-for-bit on the reported loads.
def balanced(costs: Sequence[float], world_size: int, group_sizes: Sequence[int] | None = None) -> list[int]:
    """See [Note: Balanced]. ``group_sizes`` is ignored: balance is global."""
    del group_sizes
    lpt = sorted_greedy(costs, world_size)
    if world_size == 1:
        return lpt
    lpt_max = max(_loads(costs, lpt, world_size))
    if lpt_max <= max(max(costs), math.fsum(costs) / world_size * (1 + _REL_TOL)):
        return lpt  # at the lower bound already (largest parameter or the mean)
    start = lpt
    if len(costs) * world_size <= _KK_MAX_WORK:
        kk = _karmarkar_karp(costs, world_size)
        if max(_loads(costs, kk, world_size)) < lpt_max:
            start = kk
    improved = _improve(costs, start, world_size)
    if max(_loads(costs, improved, world_size)) > lpt_max:
        return lpt
    return improved
