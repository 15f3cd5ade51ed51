"""Single-process tests of plan_buckets (and that its offsets are a ParamBucket's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.buckets import BucketPlan, ParamBucket, plan_buckets

_DTYPES = [torch.float32, torch.float64, torch.bfloat16]
_params_strategy = st.lists(
    st.tuples(st.integers(0, 40), st.sampled_from(_DTYPES), st.sampled_from(["cpu", "meta"])),
    min_size=0,
    max_size=25,
)
_SETTINGS = settings(max_examples=40, deadline=None)


def _tensors(spec: list[tuple[int, torch.dtype, str]]) -> list[torch.Tensor]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=d, device=dev)) for n, d, dev in spec]


def _align_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@_SETTINGS
@given(
    spec=_params_strategy,
    cap=st.integers(1, 200),
    first_cap=st.one_of(st.none(), st.integers(1, 200)),
    alignment=st.integers(1, 8),
    pad=st.integers(1, 4),
)
def test_plan_properties(
    spec: list[tuple[int, torch.dtype, str]],
    cap: int,
    first_cap: int | None,
    alignment: int,
    pad: int,
) -> None:
    params = _tensors(spec)
    plan = plan_buckets(params, cap, first_cap, alignment=alignment, pad_to_multiple=pad)

    # Every param exactly once; assignment agrees with the buckets.
    flat = [i for b in plan.buckets for i in b.indices]
    assert sorted(flat) == list(range(len(params)))
    for bi, b in enumerate(plan.buckets):
        for slot, i in enumerate(b.indices):
            assert plan.bucket_of(i) == (bi, slot)
    # Reverse registration order inside a bucket and across the buckets of one group.
    seen_groups: dict[tuple[str, torch.dtype], int] = {}
    for bi, b in enumerate(plan.buckets):
        assert list(b.indices) == sorted(b.indices, reverse=True)
        assert all(params[i].dtype == b.dtype and params[i].device == b.device for i in b.indices)
        key = (b.device.type, b.dtype)
        if key in seen_groups:
            prev = plan.buckets[seen_groups[key]]
            assert min(prev.indices) > max(b.indices)
        seen_groups[key] = bi
    # Buckets in order of their first (highest) index.
    firsts = [b.indices[0] for b in plan.buckets]
    assert firsts == sorted(firsts, reverse=True)
    # Offsets aligned and packed greedily, sizes padded.
    for b in plan.buckets:
        fill = 0
        for i, off in zip(b.indices, b.offsets, strict=True):
            assert off == _align_up(fill, alignment)
            fill = off + params[i].numel()
        assert b.numel == fill and b.padded_numel == _align_up(fill, pad)
        assert b.nbytes == b.padded_numel * params[b.indices[0]].element_size()
    # Caps: never exceeded except by a lone oversize param; and greedy: the next bucket of a
    # group starts with a param that did not fit in the previous one.
    effective_first = cap if first_cap is None else first_cap
    last_of_group: dict[tuple[str, torch.dtype], int] = {}
    for bi, b in enumerate(plan.buckets):
        key = (b.device.type, b.dtype)
        limit = cap if key in last_of_group else effective_first
        itemsize = params[b.indices[0]].element_size()
        if len(b.indices) > 1:
            assert b.numel * itemsize <= limit
        if key in last_of_group:
            prev = plan.buckets[last_of_group[key]]
            prev_limit = effective_first if _is_first(plan, last_of_group[key]) else cap
            head = params[b.indices[0]]
            assert (_align_up(prev.numel, alignment) + head.numel()) * itemsize > prev_limit
        last_of_group[key] = bi
    # Deterministic: same inputs, same plan, same fingerprint.
    again = plan_buckets(params, cap, first_cap, alignment=alignment, pad_to_multiple=pad)
    assert again == plan and again.fingerprint() == plan.fingerprint()


def _is_first(plan: BucketPlan, index: int) -> bool:
    b = plan.buckets[index]
    return all((o.device.type, o.dtype) != (b.device.type, b.dtype) for o in plan.buckets[:index])


def test_plan_example_matches_hand_computation() -> None:
    # Sizes in fp32 bytes: 40, 40, 400, 8, 8; reversed: 8, 8, 400, 40, 40.
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 100, 2, 2)]
    plan = plan_buckets(params, cap_bytes=100, first_bucket_cap_bytes=16)
    assert plan.bucket_indices == ((4, 3), (2,), (1, 0))
    assert [b.offsets for b in plan.buckets] == [(0, 2), (0,), (0, 10)]
    assert [b.numel for b in plan.buckets] == [4, 100, 20]
    assert len(plan) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cap_bytes = 1  # type: ignore[misc]


def test_plan_groups_by_dtype_with_a_first_cap_per_group() -> None:
    params = [
        torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)),  # 0
        torch.nn.Parameter(torch.zeros(4)),  # 1
        torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)),  # 2
        torch.nn.Parameter(torch.zeros(4)),  # 3
    ]
    plan = plan_buckets(params, cap_bytes=1000, first_bucket_cap_bytes=16)
    assert plan.bucket_indices == ((3,), (2,), (1,), (0,))
    assert [b.dtype for b in plan.buckets] == [
        torch.float32,
        torch.float64,
        torch.float32,
        torch.float64,
    ]


def test_param_buckets_filled_in_plan_order_use_the_plan_offsets() -> None:
    """The layout rules of [Note: Bucket views]: a ParamBucket sized and filled as a BucketSpec
    says (``size=numel``, params in ``indices`` order) puts each param at the planned offset."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    named = list(model.named_parameters())
    values = [p.detach().clone() for _, p in named]
    plan = plan_buckets(named, cap_bytes=100, alignment=4, pad_to_multiple=2)
    for spec in plan.buckets:
        bucket = ParamBucket(
            spec.numel,
            spec.dtype,
            spec.device,
            alignment=plan.alignment,
            pad_to_multiple=plan.pad_to_multiple,
        )
        for i in spec.indices:
            bucket.add_param(named[i][1], name=named[i][0])
        assert bucket.offsets == spec.offsets
        assert bucket.buffer.numel() == spec.padded_numel
        assert bucket.attached
    for (_, p), v in zip(named, values, strict=True):
        assert torch.equal(p.detach(), v)


def test_plan_input_errors() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"'w' \(position 1\) is the same tensor as position 0"):
        plan_buckets([("v", p), ("w", p)], 64)
    with pytest.raises(TypeError, match=r"got a single Tensor"):
        plan_buckets(p, 64)
    with pytest.raises(ValueError, match=r"cap_bytes must be an int >= 1; got 0"):
        plan_buckets([p], 0)
    with pytest.raises(TypeError, match=r"first_bucket_cap_bytes .* got float"):
        plan_buckets([p], 64, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expects a torch.Tensor"):
        plan_buckets([p, "x"], 64)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"'#1' .*layout torch.sparse_coo"):
        plan_buckets([p, torch.zeros(2, 2).to_sparse()], 64)
    with pytest.raises(ValueError, match=r"'emb' .*not contiguous"):
        plan_buckets([("emb", torch.zeros(3, 2).t())], 64)
    with pytest.raises(ValueError, match=r"bucket_of: index 5 is out of range"):
        plan_buckets([p], 64).bucket_of(5)


def test_fingerprint_ignores_device_index_but_not_layout() -> None:
    a = plan_buckets([torch.zeros(3), torch.zeros(5)], 64)
    b = plan_buckets([torch.zeros(3), torch.zeros(6)], 64)
    c = plan_buckets([torch.zeros(3), torch.zeros(5)], 64, alignment=4)
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3
