"""Element-level flat partitions: exact coverage, alignment, the imbalance bound."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.partition import FlatPartition, Fragment, ParamSpec, flat_partition

_shapes = st.lists(
    st.tuples(st.integers(0, 300), st.booleans()), min_size=1, max_size=25
)


def _specs(entries: list[tuple[int, bool]]) -> list[ParamSpec]:
    return [ParamSpec((n,), torch.float32, rg) for n, rg in entries]


@settings(max_examples=80, deadline=None)
@given(
    entries=_shapes,
    world_size=st.integers(1, 9),
    align=st.sampled_from([1, 2, 4, 16, 64]),
    param_align=st.sampled_from([1, 8]),
    pad=st.booleans(),
)
def test_every_element_assigned_exactly_once(
    entries: list[tuple[int, bool]], world_size: int, align: int, param_align: int, pad: bool
) -> None:
    specs = _specs(entries)
    fp = flat_partition(specs, world_size, align=align, param_align=param_align, pad=pad)
    # Coverage: every element of every trainable param exactly once, frozen ones never.
    for i, s in enumerate(specs):
        frags = fp.fragments_of_param(i)
        if not s.requires_grad:
            assert frags == () and fp.param_offsets[i] == -1
            continue
        covered = [(f.start, f.end) for f in frags]
        expected_start = 0
        for start, end in covered:
            assert start == expected_start and end > start
            expected_start = end
        assert expected_start == s.numel
    # Fragments sit in their rank's shard at the right place, and shards tile the buffer.
    for f in fp.fragments:
        lo, hi = fp.shard_range(f.rank)
        flat_pos = fp.param_offsets[f.param] + f.start
        assert lo <= flat_pos and flat_pos + f.numel <= hi
        assert f.shard_offset == flat_pos - lo
    assert fp.shard_size % align == 0
    if pad:
        assert fp.padded_numel == fp.shard_size * world_size
        assert fp.padded_numel % (world_size * align) == 0
    for i in range(len(specs)):
        if fp.param_offsets[i] >= 0:
            assert fp.param_offsets[i] % param_align == 0
    assert sum(fp.loads) == fp.numel == sum(s.numel for s in specs if s.requires_grad)
    assert list(fp.loads) == [sum(f.numel for f in fp.fragments_of(r)) for r in range(world_size)]
    # The alignment bound (param_align gaps excluded, see [Note: Flat layout]).
    if fp.numel and param_align == 1:
        mean = fp.numel / world_size
        assert fp.imbalance <= 1 + align / mean + 1e-12


def test_fragments_straddle_ranks() -> None:
    specs = [ParamSpec((10,), torch.float32), ParamSpec((6,), torch.float32)]
    fp = flat_partition(specs, 4)
    assert fp.shard_size == 4 and fp.padded_numel == 16
    assert fp.fragments_of_param(0) == (
        Fragment(0, 0, 0, 4, 0),
        Fragment(0, 1, 4, 8, 0),
        Fragment(0, 2, 8, 10, 0),
    )
    assert fp.fragments_of_param(1) == (Fragment(1, 2, 0, 2, 2), Fragment(1, 3, 2, 6, 0))
    assert fp.owners_of(0) == (0, 1, 2)
    assert fp.loads == (4, 4, 4, 4) and fp.imbalance == 1.0
    assert "split params" in fp.describe()


def test_padding_and_alignment() -> None:
    specs = [ParamSpec((10,), torch.float16)]
    fp = flat_partition(specs, 4, align=4)
    assert (fp.shard_size, fp.padded_numel) == (4, 16)
    assert fp.loads == (4, 4, 2, 0)
    unpadded = flat_partition(specs, 4, align=1, pad=False)
    assert (unpadded.shard_size, unpadded.padded_numel) == (3, 10)
    assert unpadded.loads == (3, 3, 3, 1)
    assert unpadded.shard_range(3) == (9, 10)
    pa = flat_partition([ParamSpec((3,), torch.float32)] * 2, 1, param_align=4)
    assert pa.param_offsets == (0, 4) and pa.padded_numel == 7


def test_frozen_params_are_left_out_unless_asked() -> None:
    specs = [ParamSpec((8,), torch.float32, False), ParamSpec((8,), torch.float32, True)]
    fp = flat_partition(specs, 2)
    assert fp.param_offsets == (-1, 0) and fp.numel == 8
    both = flat_partition(specs, 2, include_frozen=True)
    assert both.param_offsets == (0, 8) and both.loads == (8, 8)


def test_all_frozen_is_valid_and_empty() -> None:
    fp = flat_partition([ParamSpec((8,), torch.float32, False)], 3)
    assert fp.fragments == () and fp.loads == (0, 0, 0) and fp.imbalance == 1.0


def test_flat_errors() -> None:
    specs = [ParamSpec((4,), torch.float32), ParamSpec((4,), torch.bfloat16)]
    with pytest.raises(ValueError, match=r"mix dtypes.*once per dtype"):
        flat_partition(specs, 2)
    with pytest.raises(ValueError, match="align must be an int >= 1"):
        flat_partition(specs[:1], 2, align=0)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        flat_partition(specs[:1], 0)
    with pytest.raises(ValueError, match="no parameters"):
        flat_partition([], 2)
    fp = flat_partition(specs[:1], 2)
    with pytest.raises(ValueError, match="rank must be"):
        fp.fragments_of(2)
    with pytest.raises(IndexError):
        fp.fragments_of_param(5)


def test_matches_a_real_flat_buffer() -> None:
    # Build the flat buffer for real and check every fragment views the right elements.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(3, 5), (7,), (2, 2, 2), (11,)]]
    fp: FlatPartition = flat_partition(params, 3, align=4, param_align=2)
    flat = torch.zeros(fp.padded_numel)
    for i, p in enumerate(params):
        off = fp.param_offsets[i]
        flat[off : off + p.numel()] = p.detach().view(-1)
    shards = flat.split(fp.shard_size)
    for f in fp.fragments:
        piece = shards[f.rank][f.shard_offset : f.shard_offset + f.numel]
        assert torch.equal(piece, params[f.param].detach().view(-1)[f.start : f.end])
    assert math.isclose(sum(fp.loads), sum(p.numel() for p in params))
