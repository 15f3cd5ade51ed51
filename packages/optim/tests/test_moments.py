"""The Adam moments the shard stepper allocates itself ([Note: Moments in one allocation] in
``shardkit.optim._state``): the state is torch's own, key for key (order, dtype, device,
shape, values) and the steps give the same bits, for every option of Adam / AdamW, every edge
shape and the default dtype torch's ``step`` follows; the moments share one buffer per
(device, dtype); other classes and tensors with state are left alone. Single process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.optim._state import allocate_moments

_SHAPES = [(), (1,), (0,), (3,), (2, 3), (17,), (4, 1, 2)]


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    # the first param gets no gradient at the first step: it keeps no state until it has one
    return [
        None if (i == 0 and step == 0) else torch.randn(p.shape, generator=g).to(p.dtype)
        for i, p in enumerate(params)
    ]


def _run(
    cls: type[torch.optim.Optimizer], options: dict[str, Any], shapes: list[tuple[int, ...]],
    dtype: torch.dtype, ours: bool,
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:  # fmt: skip
    params = _params(shapes, dtype)
    opt = cls(params, lr=1e-2, **options)
    for step in range(3):
        for p, grad in zip(params, _grads(params, step), strict=True):
            p.grad = grad
        if ours:
            allocate_moments(opt, [p for p in params if p.grad is not None])
        opt.step()
    return params, opt


@settings(max_examples=30, deadline=None)
@given(
    cls=st.sampled_from([torch.optim.Adam, torch.optim.AdamW]),
    fused=st.booleans(),
    foreach=st.booleans(),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.1]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    shapes=st.lists(st.sampled_from(_SHAPES), min_size=1, max_size=5),
    default_fp64=st.booleans(),
)
def test_the_state_is_torchs_own(
    cls: type[torch.optim.Optimizer], fused: bool, foreach: bool, amsgrad: bool,
    maximize: bool, weight_decay: float, dtype: torch.dtype, shapes: list[tuple[int, ...]],
    default_fp64: bool,
) -> None:  # fmt: skip
    options: dict[str, Any] = {
        "amsgrad": amsgrad, "maximize": maximize, "weight_decay": weight_decay,
        **({"fused": True} if fused else {"foreach": foreach}),
    }  # fmt: skip
    saved = torch.get_default_dtype()
    if default_fp64:
        torch.set_default_dtype(torch.float64)
    try:
        ref_params, ref = _run(cls, options, shapes, dtype, ours=False)
        params, opt = _run(cls, options, shapes, dtype, ours=True)
    finally:
        torch.set_default_dtype(saved)
    for p_ref, p in zip(ref_params, params, strict=True):
        assert torch.equal(p_ref, p)
        want, got = ref.state[p_ref], opt.state[p]
        assert list(got) == list(want)
        for key, v in want.items():
            assert got[key].dtype == v.dtype and got[key].device == v.device, key
            assert got[key].shape == v.shape, key
            assert torch.equal(got[key], v), key
    # the moments made together share one buffer per dtype (the first param was made later)
    stored = {
        opt.state[p][k].untyped_storage().data_ptr()
        for p in params[1:]
        if p.numel()
        for k in ("exp_avg", "exp_avg_sq")
    }
    assert len(stored) <= 1


def test_other_classes_and_tensors_with_state_are_left_alone() -> None:
    params = _params([(3,), (4,)], torch.float32)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    allocate_moments(sgd, params)
    assert not sgd.state

    class MyAdam(torch.optim.Adam):
        pass

    mine = MyAdam(params, lr=0.1)
    allocate_moments(mine, params)
    assert not mine.state
    adam = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()
    before = {id(p): dict(adam.state[p]) for p in params}
    allocate_moments(adam, params)
    for p in params:
        assert all(adam.state[p][k] is v for k, v in before[id(p)].items())


def test_differentiable_groups_keep_torchs_initialisation() -> None:
    params = _params([(3,)], torch.float32)
    opt = torch.optim.Adam(params, lr=0.1, differentiable=True)
    allocate_moments(opt, params)
    assert not opt.state


@pytest.mark.parametrize("amsgrad", [False, True])
def test_one_allocation_holds_every_moment(amsgrad: bool) -> None:
    params = _params([(5,), (2, 3), ()], torch.float32)
    opt = torch.optim.AdamW(params, lr=0.1, amsgrad=amsgrad, fused=True)
    allocate_moments(opt, params)
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    views = [opt.state[p][k] for p in params for k in keys]
    base = views[0].untyped_storage()
    assert all(v.untyped_storage().data_ptr() == base.data_ptr() for v in views)
    assert base.nbytes() == sum(v.nbytes for v in views)
