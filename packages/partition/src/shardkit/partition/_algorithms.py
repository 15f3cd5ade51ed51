"""The whole-parameter balancers: pure functions from costs to an owning rank per parameter.

``greedy``, ``sorted_greedy`` and the differencing pass live here; ``balanced`` (LPT plus a
budgeted local search) lives in ``_balanced.py``.

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
# - the local search of ``balanced`` (``_balanced.py``) always works on the lowest-numbered
#   most-loaded rank, tries target ranks from least to most loaded (smallest rank first on
#   equal load), and among equally good moves or swaps takes the first found scanning items
#   in (cost, index) order; re-splits scan items in (cost, index) order, group equal costs
#   into pseudo-items in that order, and keep the first sum reaching each cell.
# Loads reported to users are ``math.fsum`` over each rank's costs: exactly rounded, hence
# independent of the order in which an algorithm happened to add them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__: list[str] = []


def _segments(n: int, group_sizes: Sequence[int] | None) -> list[range]:
    if group_sizes is None:
        return [range(n)]
    out: list[range] = []
    start = 0
    for size in group_sizes:
        out.append(range(start, start + size))
        start += size
    return out


def greedy(
    costs: Sequence[float], world_size: int, group_sizes: Sequence[int] | None = None
) -> list[int]:
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
