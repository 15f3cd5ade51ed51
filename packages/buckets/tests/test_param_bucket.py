"""Single-process tests of ParamBucket: layout, storage sharing, to(), errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.buckets import ParamBucket

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
_shapes = st.lists(
    st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
)
_SETTINGS = settings(max_examples=30, deadline=None)


def _align_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _needed(shapes: list[tuple[int, ...]], alignment: int) -> int:
    fill = 0
    for shape in shapes:
        fill = _align_up(fill, alignment) + int(torch.Size(shape).numel())
    return fill


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))
        for shape in shapes
    ]


@_SETTINGS
@given(
    shapes=_shapes,
    dtype=st.sampled_from(_DTYPES),
    alignment=st.integers(1, 8),
    pad=st.integers(1, 5),
    slack=st.integers(0, 7),
    seed=st.integers(0, 2**16),
)
def test_values_preserved_and_views_share_storage(
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    alignment: int,
    pad: int,
    slack: int,
    seed: int,
) -> None:
    params = _params(shapes, dtype, seed)
    originals = [p.detach().clone() for p in params]
    size = _needed(shapes, alignment) + slack
    bucket = ParamBucket(size, dtype, "cpu", alignment=alignment, pad_to_multiple=pad)
    for p in params:
        bucket.add_param(p)

    assert bucket.buffer.numel() == _align_up(size, pad)
    assert bucket.buffer.numel() % pad == 0
    assert bucket.attached
    storage = bucket.buffer.untyped_storage().data_ptr()
    covered = torch.zeros(bucket.buffer.numel(), dtype=torch.bool)
    for p, original, offset in zip(params, originals, bucket.offsets, strict=True):
        assert offset % alignment == 0
        assert torch.equal(p.detach(), original)
        assert p.shape == original.shape and p.dtype == dtype
        if p.numel() > 0:
            assert p.untyped_storage().data_ptr() == storage
            assert p.storage_offset() == offset
        assert torch.equal(bucket.slot(p), original.reshape(-1))
        covered[offset : offset + p.numel()] = True
    # Alignment gaps and the padded tail stay zero.
    assert torch.all(bucket.buffer[~covered] == 0)
    # A write through the buffer is visible in the params, and vice versa.
    with torch.no_grad():
        bucket.buffer.add_(1)
        for p, original in zip(params, originals, strict=True):
            assert torch.equal(p.detach(), original + 1)
        if params[0].numel() > 0:
            params[0].mul_(0)
            assert torch.all(bucket.slot(0) == 0)


@_SETTINGS
@given(
    shapes=_shapes,
    pair=st.sampled_from(
        [
            (torch.float32, torch.float64),
            (torch.bfloat16, torch.float32),
            (torch.float16, torch.float32),
            (torch.float16, torch.float64),
        ]
    ),
    alignment=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_to_dtype_round_trip_keeps_values_and_sharing(
    shapes: list[tuple[int, ...]],
    pair: tuple[torch.dtype, torch.dtype],
    alignment: int,
    seed: int,
) -> None:
    low, high = pair
    params = _params(shapes, low, seed)
    originals = [p.detach().clone() for p in params]
    bucket = ParamBucket(_needed(shapes, alignment), low, "cpu", alignment=alignment)
    for p in params:
        bucket.add_param(p)

    assert bucket.to(dtype=high) is bucket
    assert bucket.dtype == high and bucket.attached
    for p, original in zip(params, originals, strict=True):
        assert p.dtype == high
        assert torch.equal(p.detach(), original.to(high))
    bucket.to(dtype=low)
    assert bucket.attached
    storage = bucket.buffer.untyped_storage().data_ptr()
    for p, original in zip(params, originals, strict=True):
        assert p.dtype == low
        assert torch.equal(p.detach(), original)  # widening then narrowing is exact
        if p.numel() > 0:
            assert p.untyped_storage().data_ptr() == storage


def test_optimizer_updates_the_buffer_and_matches_unbucketed_training() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    model.load_state_dict(ref.state_dict())
    params = list(model.parameters())
    bucket = ParamBucket(sum(p.numel() for p in params), torch.float32, "cpu")
    for name, p in model.named_parameters():
        bucket.add_param(p, name=name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, foreach=True)
    x = torch.randn(8, 5)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    assert bucket.attached
    flat_ref = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    assert torch.equal(bucket.buffer, flat_ref)


def test_to_keep_param_alignment_false_detaches_until_reattach() -> None:
    p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    q = torch.nn.Parameter(torch.ones(4))
    bucket = ParamBucket(10, torch.float32, "cpu")
    bucket.add_param(p)
    bucket.add_param(q)
    old_ptr = bucket.buffer.data_ptr()
    bucket.to(dtype=torch.float64, keep_param_alignment=False)
    assert bucket.dtype == torch.float64
    assert p.dtype == torch.float32 and p.data_ptr() == old_ptr  # params untouched
    assert not bucket.attached
    with torch.no_grad():
        p.add_(1)  # the params' current values win on reattach
    bucket.reattach()
    assert bucket.attached and p.dtype == torch.float64
    assert torch.equal(p.detach(), torch.arange(1.0, 7.0, dtype=torch.float64).reshape(2, 3))
    assert torch.equal(bucket.slot(q), torch.ones(4, dtype=torch.float64))


def test_reattach_after_module_replaced_param_data() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    bucket = ParamBucket(3, torch.float32, "cpu")
    bucket.add_param(p)
    p.data = torch.full((3,), 7.0)  # e.g. load_state_dict(assign=True) or module.to()
    assert not bucket.attached
    bucket.reattach()
    assert bucket.attached and torch.equal(bucket.buffer, torch.full((3,), 7.0))


def test_to_refuses_to_orphan_grads() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    bucket = ParamBucket(3, torch.float32, "cpu")
    bucket.add_param(p)
    with pytest.raises(ValueError, match=r"has a \.grad .*set_to_none=True"):
        bucket.to(dtype=torch.float64)
    assert bucket.dtype == torch.float32 and bucket.attached  # nothing changed
    bucket.to(dtype=torch.float32)  # no change: allowed
    p.grad = None
    bucket.to(dtype=torch.float64)
    assert p.dtype == torch.float64


def test_shard_splits_a_padded_buffer() -> None:
    bucket = ParamBucket(7, torch.float32, "cpu", pad_to_multiple=3)
    p = torch.nn.Parameter(torch.arange(7.0))
    bucket.add_param(p)
    shards = [bucket.shard(r, 3) for r in range(3)]
    assert [s.numel() for s in shards] == [3, 3, 3]
    assert torch.equal(torch.cat(shards), torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 0.0]))
    with pytest.raises(ValueError, match=r"9 elements, which is not a multiple of world_size=2"):
        bucket.shard(0, 2)
    with pytest.raises(ValueError, match=r"rank must be < world_size=3"):
        bucket.shard(3, 3)


# ---------------------------------------------------------------------- errors
def test_over_capacity_names_param_and_sizes() -> None:
    bucket = ParamBucket(10, torch.float32, "cpu", alignment=4)
    bucket.add_param(torch.nn.Parameter(torch.zeros(3)), name="a")
    with pytest.raises(ValueError, match=r"'b' .*needs elements \[4, 11\).*capacity is 10"):
        bucket.add_param(torch.nn.Parameter(torch.zeros(7)), name="b")
    assert len(bucket) == 1 and bucket.fill == 3  # a failed add changes nothing


def test_added_twice() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    bucket = ParamBucket(10, torch.float32, "cpu")
    bucket.add_param(p, name="w")
    with pytest.raises(ValueError, match=r"'w' .*already in this bucket \(slot 0, offset 0\)"):
        bucket.add_param(p, name="w")


def test_dtype_and_device_mismatch() -> None:
    bucket = ParamBucket(10, torch.float32, "cpu")
    with pytest.raises(TypeError, match=r"'h' .*dtype torch.float16 but the bucket holds"):
        bucket.add_param(torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)), name="h")
    meta = ParamBucket(10, torch.float32, "meta")
    with pytest.raises(ValueError, match=r"is on cpu but the bucket is on meta"):
        meta.add_param(torch.nn.Parameter(torch.zeros(2)))


def test_sparse_noncontiguous_nonleaf_and_non_tensor() -> None:
    bucket = ParamBucket(100, torch.float32, "cpu")
    sparse = torch.zeros(3, 3).to_sparse().requires_grad_()
    with pytest.raises(ValueError, match=r"layout torch.sparse_coo"):
        bucket.add_param(sparse)
    with pytest.raises(ValueError, match=r"not contiguous \(strides \(1, 3\)\)"):
        bucket.add_param(torch.nn.Parameter(torch.zeros(4, 3).t()))
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"not a leaf tensor .*MulBackward0"):
        bucket.add_param(leaf * 2)
    with pytest.raises(TypeError, match=r"expects a torch.Tensor .*got list"):
        bucket.add_param([1.0, 2.0])  # type: ignore[arg-type]
    assert len(bucket) == 0


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"size": -1}, ValueError, "size .* must be an int >= 0; got -1"),
        ({"size": 2.5}, TypeError, "size .* got float 2.5"),
        ({"size": True}, TypeError, "got bool True"),
        ({"dtype": "float32"}, TypeError, "dtype must be a torch.dtype"),
        ({"device": 1.0}, TypeError, "device must be a torch.device"),
        ({"device": "gpu"}, ValueError, "not a valid device: 'gpu'"),
        ({"alignment": 0}, ValueError, "alignment .* >= 1; got 0"),
        ({"pad_to_multiple": 0}, ValueError, "pad_to_multiple must be an int >= 1"),
    ],
)
def test_constructor_validation(
    kwargs: dict[str, object], exc: type[Exception], pattern: str
) -> None:
    args: dict[str, object] = {"size": 4, "dtype": torch.float32, "device": "cpu"}
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        ParamBucket(**args)  # type: ignore[arg-type]


def test_slot_and_index_errors() -> None:
    bucket = ParamBucket(4, torch.float32, "cpu")
    p = torch.nn.Parameter(torch.zeros(2))
    bucket.add_param(p)
    assert bucket.index(p) == 0
    with pytest.raises(ValueError, match=r"not registered in this bucket"):
        bucket.slot(torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(ValueError, match=r"index 1 is out of range"):
        bucket.slot(1)
    with pytest.raises(TypeError, match=r"registered tensor or its int index"):
        bucket.slot("p")  # type: ignore[arg-type]
