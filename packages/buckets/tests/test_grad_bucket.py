"""Single-process tests of GradBucket: autograd into views, collapse/rebuild, reattach, hooks."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.buckets import GradBucket

_shapes = st.lists(
    st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
)
_SETTINGS = settings(max_examples=30, deadline=None)


def _align_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _bucket_for(
    params: list[torch.Tensor], alignment: int = 1, dtype: torch.dtype = torch.float64
) -> GradBucket:
    fill = 0
    for p in params:
        fill = _align_up(fill, alignment) + p.numel()
    bucket = GradBucket(fill, dtype, "cpu", alignment=alignment)
    for p in params:
        bucket.add_grad(p)
    return bucket


def _make(
    shapes: list[tuple[int, ...]], seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes
    ]
    coefs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    return params, coefs


def _loss(params: list[torch.Tensor], coefs: list[torch.Tensor]) -> torch.Tensor:
    # d loss / d p == c, so grads are known exactly.
    return sum(
        ((p * c).sum() for p, c in zip(params, coefs, strict=True)),
        torch.zeros((), dtype=torch.float64),
    )


def _is_view(bucket: GradBucket, p: torch.Tensor) -> bool:
    grad = p.grad
    return (
        grad is not None
        and grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
        and grad.storage_offset() == bucket.offsets[bucket.index(p)]
    )


@_SETTINGS
@given(
    shapes=_shapes, alignment=st.integers(1, 6), steps=st.integers(1, 3), seed=st.integers(0, 2**16)
)
def test_autograd_accumulates_into_grad_views(
    shapes: list[tuple[int, ...]], alignment: int, steps: int, seed: int
) -> None:
    params, coefs = _make(shapes, seed)
    bucket = _bucket_for(params, alignment)
    assert bucket.attached
    for _ in range(steps):
        _loss(params, coefs).backward()
    assert bucket.attached
    for p, c in zip(params, coefs, strict=True):
        assert p.grad is not None
        assert torch.allclose(p.grad, c * steps, rtol=0, atol=1e-12)
        assert torch.equal(bucket.slot(p).view(p.shape), p.grad)
        if p.numel() > 0:
            assert _is_view(bucket, p)
    bucket.zero_()
    assert bucket.attached and torch.all(bucket.buffer == 0)


@_SETTINGS
@given(shapes=_shapes, alignment=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_collapse_rebuild_keeps_params_layout_and_new_grads(
    shapes: list[tuple[int, ...]], alignment: int, seed: int
) -> None:
    params, coefs = _make(shapes, seed)
    values = [p.detach().clone() for p in params]
    bucket = _bucket_for(params, alignment)
    offsets, numel = bucket.offsets, bucket.buffer.numel()
    _loss(params, coefs).backward()

    bucket.collapse()
    assert bucket.collapsed and not bucket.attached
    assert bucket.buffer.numel() == 0
    assert all(p.grad is None for p in params)
    bucket.collapse()  # idempotent
    # A backward while collapsed produces ordinary grads; rebuild keeps them.
    _loss(params, coefs).backward()
    bucket.rebuild()
    assert not bucket.collapsed and bucket.attached
    assert bucket.offsets == offsets and bucket.buffer.numel() == numel
    for p, c, v in zip(params, coefs, values, strict=True):
        assert torch.equal(p.detach(), v)
        assert torch.equal(bucket.slot(p).view(p.shape), c)
    # And autograd accumulates into the rebuilt views again.
    _loss(params, coefs).backward()
    for p, c in zip(params, coefs, strict=True):
        assert p.grad is not None and torch.allclose(p.grad, 2 * c, rtol=0, atol=1e-12)
    assert bucket.attached


def test_collapse_then_rebuild_without_backward_gives_zero_views() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    bucket = GradBucket(4, torch.float32, "cpu")
    bucket.add_grad(p)
    (p * 3).sum().backward()
    bucket.collapse()
    bucket.rebuild()
    assert bucket.attached and p.grad is not None and torch.equal(p.grad, torch.zeros(4))
    bucket.rebuild()  # no-op when not collapsed
    assert bucket.attached


def test_collapse_warns_when_a_view_is_kept_elsewhere() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    bucket = GradBucket(4, torch.float32, "cpu")
    bucket.add_grad(p)
    kept = p.grad
    with pytest.warns(ResourceWarning, match=r"still referenced elsewhere"):
        bucket.collapse()
    assert p.grad is None
    del kept
    bucket.rebuild()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bucket.collapse()  # nothing else holds the buffer now: no warning


def test_add_grad_keeps_an_existing_grad() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    bucket = GradBucket(3, torch.float32, "cpu")
    bucket.add_grad(p)
    assert torch.equal(bucket.buffer, torch.tensor([1.0, 2.0, 3.0])) and bucket.attached


def test_zero_grad_set_to_none_then_reattach() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    bucket = GradBucket(8, torch.float32, "cpu")
    for p in params:
        bucket.add_grad(p)
    opt = torch.optim.SGD(params, lr=0.1)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    opt.zero_grad()  # set_to_none=True: the views are gone
    assert all(p.grad is None for p in params) and not bucket.attached

    # Case 1: re-attach before the next backward -> zeroed views.
    bucket.reattach()
    assert bucket.attached and torch.all(bucket.buffer == 0)
    model(x).sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).clone()
    assert torch.equal(bucket.buffer, expected)

    # Case 2: backward ran first (fresh, unrelated grads) -> reattach copies them in.
    opt.zero_grad()
    model(x).sum().backward()
    assert not bucket.attached
    bucket.buffer.fill_(123.0)  # stale values must not leak into the grads
    bucket.reattach()
    assert bucket.attached and torch.equal(bucket.buffer, expected)


def test_check_in_and_full_from_post_accumulate_hooks() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    params = list(model.parameters())
    bucket = GradBucket(sum(p.numel() for p in params), torch.float32, "cpu", destination=1)
    for p in params:
        bucket.add_grad(p)
    assert bucket.destination == 1 and bucket.params_checked_in == 0 and not bucket.full
    snapshots: list[torch.Tensor] = []

    def hook(p: torch.Tensor) -> None:
        if bucket.check_in(p):
            snapshots.append(bucket.buffer.clone())  # where a reduce would be launched

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    try:
        model(torch.ones(2, 3)).sum().backward()
        assert bucket.full and bucket.params_checked_in == len(params)
        assert len(snapshots) == 1
        assert torch.equal(snapshots[0], bucket.buffer)  # every grad was in when full
        with pytest.raises(RuntimeError, match=r"already checked in .*reset_checked_in"):
            bucket.check_in(params[0])
        bucket.reset_checked_in()
        assert bucket.params_checked_in == 0
        model(torch.ones(2, 3)).sum().backward()
        assert len(snapshots) == 2 and torch.equal(snapshots[1], 2 * snapshots[0])
    finally:
        for h in handles:
            h.remove()
    with pytest.raises(ValueError, match=r"not registered in this bucket"):
        bucket.check_in(torch.nn.Parameter(torch.zeros(1)))


def test_to_moves_grads_and_keeps_sharing() -> None:
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad_dtype = None  # accept grads of any dtype
    bucket = GradBucket(2, torch.float64, "cpu")
    bucket.add_grad(p)
    bucket.buffer.fill_(0.5)
    bucket.to(dtype=torch.float32)
    assert bucket.attached and p.grad is not None and p.grad.dtype == torch.float32
    assert torch.equal(p.grad, torch.full((2,), 0.5))


def test_to_rejects_a_dtype_params_cannot_take() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    bucket = GradBucket(2, torch.float32, "cpu")
    bucket.add_grad(p)
    with pytest.raises(
        TypeError, match=r"takes grads of dtype torch.float32 but the bucket holds torch.float64"
    ):
        bucket.to(dtype=torch.float64)
    assert bucket.attached and bucket.dtype == torch.float32
    bucket.to(dtype=torch.float64, keep_param_alignment=False)
    assert bucket.dtype == torch.float64 and not bucket.attached
    assert p.grad is not None and p.grad.dtype == torch.float32


def test_to_on_collapsed_bucket_changes_where_rebuild_allocates() -> None:
    # A bf16 param whose grads accumulate in fp32 (torch's grad_dtype), moved between dtypes
    # while collapsed, the pattern for changing a param bucket and its grad bucket together.
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    p.grad_dtype = torch.float32
    bucket = GradBucket(3, torch.float32, "cpu")
    bucket.add_grad(p)
    (p.float() * 0.25).sum().backward()
    assert bucket.attached and p.grad is not None and p.grad.dtype == torch.float32
    assert torch.equal(bucket.buffer, torch.full((3,), 0.25))
    bucket.collapse()
    p.grad_dtype = torch.float64
    bucket.to(dtype=torch.float64)
    assert bucket.collapsed and bucket.dtype == torch.float64
    bucket.rebuild()
    (p.double() * 0.5).sum().backward()
    assert bucket.attached and torch.equal(
        bucket.buffer, torch.full((3,), 0.5, dtype=torch.float64)
    )


# ---------------------------------------------------------------------- errors
def test_requires_grad_false_is_rejected() -> None:
    bucket = GradBucket(4, torch.float32, "cpu")
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    with pytest.raises(ValueError, match=r"'frozen' .*requires_grad=False"):
        bucket.add_grad(frozen, name="frozen")


def test_grad_dtype_and_device_mismatch() -> None:
    bucket = GradBucket(4, torch.float32, "cpu")
    with pytest.raises(TypeError, match=r"'w' .*takes grads of dtype torch.float64 .*grad_dtype"):
        bucket.add_grad(torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)), name="w")
    meta = GradBucket(4, torch.float32, "meta")
    with pytest.raises(ValueError, match=r"is on cpu but the bucket is on meta"):
        meta.add_grad(torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(TypeError, match=r"floating point or complex dtype"):
        GradBucket(4, torch.int64, "cpu")


def test_over_capacity_twice_sparse_grad_and_collapsed() -> None:
    bucket = GradBucket(4, torch.float32, "cpu")
    p = torch.nn.Parameter(torch.zeros(3))
    bucket.add_grad(p, name="p")
    with pytest.raises(ValueError, match=r"already in this bucket"):
        bucket.add_grad(p)
    with pytest.raises(
        ValueError, match=r"'q' .*needs elements \[3, 5\) but the bucket capacity is 4"
    ):
        bucket.add_grad(torch.nn.Parameter(torch.zeros(2)), name="q")
    e = torch.nn.Parameter(torch.zeros(1))
    e.grad = torch.zeros(1).to_sparse()
    with pytest.raises(ValueError, match=r"sparse_coo grad"):
        bucket.add_grad(e)
    assert len(bucket) == 1
    bucket.collapse()
    with pytest.raises(RuntimeError, match=r"collapsed; call rebuild"):
        bucket.add_grad(torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(RuntimeError, match=r"collapsed; call rebuild"):
        bucket.reattach()
    with pytest.raises(RuntimeError, match=r"collapsed; call rebuild"):
        bucket.check_in(p)
    bucket.zero_()  # no-op while collapsed


@pytest.mark.parametrize(("dest", "exc"), [(-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_destination_validation(dest: object, exc: type[Exception]) -> None:
    with pytest.raises(exc, match=r"destination"):
        GradBucket(4, torch.float32, "cpu", dest)  # type: ignore[arg-type]
