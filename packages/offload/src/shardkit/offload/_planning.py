"""Balanced contiguous slicing of a layer sequence (optimal linear partition)."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["balanced_slices", "module_bytes"]


def module_bytes(module: nn.Module) -> int:
    """Bytes of the parameters and buffers of ``module`` (what a slice transfer moves).

    Tensors shared inside ``module`` are counted once.
    """
    seen: set[int] = set()
    total = 0
    tensors: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def balanced_slices(costs: Sequence[float], num_slices: int) -> list[range]:
    """Split ``costs`` into ``num_slices`` contiguous, non-empty slices minimising the largest sum.

    This is the optimal linear partition (not a greedy fill): the returned split has the smallest
    possible maximum slice cost among all contiguous splits into exactly ``num_slices`` slices.

    Args:
        costs: Non-negative, finite cost of each item (layer), in order.
        num_slices: Number of slices, ``1 <= num_slices <= len(costs)``.

    Returns:
        ``num_slices`` consecutive ranges of item indices covering ``range(len(costs))``.

    Raises:
        TypeError: ``num_slices`` is not an ``int``.
        ValueError: ``num_slices`` is out of range or a cost is negative or not finite.
    """
    if isinstance(num_slices, bool) or not isinstance(num_slices, int):
        raise TypeError(
            f"num_slices must be an int, got {type(num_slices).__name__} {num_slices!r}"
        )
    n = len(costs)
    if num_slices < 1 or num_slices > n:
        raise ValueError(
            f"num_slices must be between 1 and the number of layers ({n}), got {num_slices}; "
            "pass fewer slices or split the model into more layers"
        )
    for i, c in enumerate(costs):
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"cost of layer {i} must be finite and >= 0, got {c!r}")

    prefix = [0.0] * (n + 1)
    for i, c in enumerate(costs):
        prefix[i + 1] = prefix[i] + float(c)

    # best[j][i]: smallest possible max slice cost splitting items [0, i) into j + 1 slices.
    # cut[j][i]: start of the last slice in that optimal split.
    # best[j - 1][m] is non-decreasing in m (costs are >= 0) while prefix[i] - prefix[m] is
    # non-increasing, so the optimal cut is where the two cross: found by bisection, giving
    # O(num_slices * n log n) with an exact optimum.
    best: list[list[float]] = [prefix[:]]
    cut: list[list[int]] = [[0] * (n + 1)]
    for j in range(1, num_slices):
        prev = best[j - 1]
        row = [math.inf] * (n + 1)
        row_cut = [0] * (n + 1)
        for i in range(j + 1, n + 1):
            lo, hi = j, i - 1  # last slice is [m, i) with j <= m <= i - 1
            # smallest m in [lo, hi] with prev[m] >= prefix[i] - prefix[m]
            keys = _CrossingKeys(prev, prefix, i)
            m = bisect_left(keys, True, lo, hi + 1)
            best_val = math.inf
            best_m = lo
            for cand in (m - 1, m):
                if lo <= cand <= hi:
                    val = max(prev[cand], prefix[i] - prefix[cand])
                    if val < best_val:
                        best_val, best_m = val, cand
            row[i] = best_val
            row_cut[i] = best_m
        best.append(row)
        cut.append(row_cut)

    bounds = [n]
    end = n
    for j in range(num_slices - 1, 0, -1):
        end = cut[j][end]
        bounds.append(end)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(num_slices)]


class _CrossingKeys:
    """Lazy boolean sequence ``prev[m] >= prefix[i] - prefix[m]`` for :func:`bisect_left`."""

    def __init__(self, prev: list[float], prefix: list[float], i: int) -> None:
        self._prev = prev
        self._prefix = prefix
        self._i = i

    def __getitem__(self, m: int) -> bool:
        return self._prev[m] >= self._prefix[self._i] - self._prefix[m]

    def __len__(self) -> int:
        return len(self._prev)
