"""The exact-tiling check of a tensor's chunks against a brute-force count of every element
(see [Note: Exact tiling])."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.checkpoint import UnsafeCheckpointError
from shardkit.checkpoint._metadata import check_tiling

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _covered_once(size: tuple[int, ...], boxes: list[Box]) -> bool:
    count = torch.zeros(size, dtype=torch.int64)
    for offsets, sizes in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    return bool((count == 1).all())


def _cuts(n: int, draw: st.DrawFn) -> list[int]:
    inner = draw(st.lists(st.integers(0, n), max_size=3))
    return sorted({0, n, *inner})


@st.composite
def grid(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A shape (0 to 3 dims, edge sizes 0 and 1 included) cut into a grid of chunks."""
    size = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    cuts = [_cuts(n, draw) for n in size]
    boxes: list[Box] = []
    for cell in itertools.product(*(list(zip(c, c[1:])) or [(0, 0)] for c in cuts)):
        boxes.append((tuple(a for a, _ in cell), tuple(b - a for a, b in cell)))
    return size, boxes


@given(grid())
@settings(max_examples=200, deadline=None)
def test_a_grid_of_chunks_tiles_its_tensor(case: tuple[tuple[int, ...], list[Box]]) -> None:
    size, boxes = case
    check_tiling(size, boxes, "t")


@given(grid(), st.data())
@settings(max_examples=300, deadline=None)
def test_a_moved_resized_or_dropped_chunk_is_refused_unless_it_still_tiles(
    case: tuple[tuple[int, ...], list[Box]], data: st.DataObject
) -> None:
    size, boxes = case
    if not boxes or not size:
        return
    i = data.draw(st.integers(0, len(boxes) - 1))
    how = data.draw(st.sampled_from(["drop", "move", "resize", "duplicate"]))
    offsets, sizes = boxes[i]
    d = data.draw(st.integers(0, len(size) - 1))
    if how == "drop":
        boxes = boxes[:i] + boxes[i + 1 :]
    elif how == "duplicate":
        boxes = [*boxes, boxes[i]]
    else:
        o, s = list(offsets), list(sizes)
        if how == "move":
            o[d] = data.draw(st.integers(0, size[d] - s[d])) if s[d] <= size[d] else o[d]
        else:
            s[d] = data.draw(st.integers(0, size[d] - o[d]))
        boxes = [*boxes[:i], (tuple(o), tuple(s)), *boxes[i + 1 :]]
    if _covered_once(size, boxes):
        check_tiling(size, boxes, "t")
    else:
        with pytest.raises(UnsafeCheckpointError, match="do not tile it exactly"):
            check_tiling(size, boxes, "t")


def test_the_issue_overlap_is_refused() -> None:
    with pytest.raises(UnsafeCheckpointError, match="do not tile it exactly"):
        check_tiling((16,), [((0,), (8,)), ((4,), (8,))], "bias")


def test_splits_along_too_many_dims_are_refused_as_beyond_the_work_bound() -> None:
    size = (2,) * 30
    boxes = [((0,) * 30, (1,) * 30)]
    with pytest.raises(UnsafeCheckpointError, match="beyond the work bound"):
        check_tiling(size, boxes, "t")
