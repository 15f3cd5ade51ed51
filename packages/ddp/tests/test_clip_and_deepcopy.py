"""Issue 26: torch's ``clip_grad_norm_`` under ShardedDataParallel raises instead of returning
0.0, the wrapper's clip raises after ``step()`` or twice, and ``copy.deepcopy`` of the wrapped
module gives a plain module.

References: torch DDP + the plain optimizer (+ torch's ``clip_grad_norm_``) at world 2. Params
are equal bit for bit where no clip is involved; the clip norm is summed in another order (per
bucket shard, then over ranks), so norms and clipped params are compared with rtol 1e-5.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

_PLACEHOLDER_ERROR = "ShardedDataParallel.clip_grad_norm_"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3)
    )


def _loss(m: nn.Module, step: int, rank: int | None = None) -> Any:
    r = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1000 * step + r)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    return nn.functional.mse_loss(m(x), y)


def _wrap(m: nn.Module, **kw: Any) -> tuple[ShardedDataParallel, ShardedOptimizer]:
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.5, momentum=0.9)
    return ShardedDataParallel(m, opt, reduce_buffer_size=64, **kw), opt


@world(2)
def test_torch_clip_raises_and_wrapper_clip_matches_ddp() -> None:
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.SGD(ref_m.parameters(), lr=0.5, momentum=0.9)
    sdp, opt = _wrap(m)
    for step in range(3):
        ref_opt.zero_grad()
        _loss(ref, step).backward()
        want = torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.05)
        ref_opt.step()
        opt.zero_grad()
        _loss(sdp, step).backward()
        for foreach in (None, False, True):
            with pytest.raises(RuntimeError, match=_PLACEHOLDER_ERROR):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=foreach)
        grads = [p.grad for p in m.parameters()]
        with pytest.raises(RuntimeError, match="reduce-scattered"):
            torch._foreach_norm(grads)
        with pytest.raises(RuntimeError, match=_PLACEHOLDER_ERROR):
            grads[0].mul_(2.0)
        got = sdp.clip_grad_norm_(0.05)
        opt.step()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        assert want > 0.05  # the clip is active
    for a, b in zip(ref_m.parameters(), sdp.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@world(2)
def test_placeholder_grads_are_metadata_only_and_never_reach_autograd() -> None:
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.SGD(ref_m.parameters(), lr=0.5, momentum=0.9)
    sdp, opt = _wrap(m)
    _loss(sdp, 0).backward()
    for p in m.parameters():
        g = p.grad
        assert g is not None and isinstance(g, torch.Tensor)
        assert (g.shape, g.dtype, g.device, g.is_sparse, g.layout) == (
            p.shape,
            p.dtype,
            p.device,
            False,
            torch.strided,
        )
        assert g.size() == p.size() and g.dim() == p.dim() and g.numel() == p.numel()
        assert "reduce-scattered by ShardedDataParallel" in repr(g) and f"{g}" == repr(g)
        assert g.untyped_storage().nbytes() == g.element_size()  # one shared 0-d zero
    # every placeholder expands the same 4-byte zero: no gradient memory besides the shards
    assert len({p.grad.untyped_storage().data_ptr() for p in m.parameters()}) == 1
    # A second backward over the same graph: the placeholders are dropped before
    # AccumulateGrad, and the two reductions add up as .grad does under DDP.
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    ref_opt.zero_grad()
    opt.zero_grad()
    out = sdp(x).square().mean()
    out.backward(retain_graph=True)
    out.backward()
    for _ in range(2):  # DDP reduces one backward per forward: two forwards
        ref(x).square().mean().backward()
    ref_opt.step()
    opt.step()
    # DDP all-reduces (its reduced first gradient + the local second one); this package adds
    # the reduced second gradient to its reduced first one: the same sum in another order.
    for a, b in zip(ref_m.parameters(), sdp.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert all(p.grad is not None for p in m.parameters())  # placeholders stay after step
    # no_sync: real local gradients in .grad, as under DDP.
    ref_opt.zero_grad()
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    with ref.no_sync(), sdp.no_sync():
        _loss(ref, 1).backward()
        _loss(sdp, 1).backward()
    for a, b in zip(ref_m.parameters(), sdp.parameters(), strict=True):
        assert type(b.grad) is torch.Tensor  # the params differ by the rounding above
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("how", ["wrapper", "optimizer", "module", "plain_foreach"])
@world(2)
def test_zero_grad_set_to_none_false_with_placeholders(how: str) -> None:
    m = _model()
    sdp, opt = _wrap(m)
    _loss(sdp, 0).backward()
    if how == "wrapper":
        sdp.zero_grad(set_to_none=False)
    elif how == "optimizer":
        opt.zero_grad(set_to_none=False)
    elif how == "module":  # nn.Module.zero_grad: grad_fn, requires_grad_(False), zero_()
        m.zero_grad(set_to_none=False)
    else:  # torch.optim.Optimizer.zero_grad with foreach: torch._foreach_zero_
        torch.optim.SGD(m.parameters(), lr=0.1, foreach=True).zero_grad(set_to_none=False)
    if how in ("wrapper", "optimizer"):  # the reduced gradients are dropped with them
        assert all(p.grad is None for p in m.parameters())
        with pytest.raises(RuntimeError, match="found no gradient to clip"):
            opt.clip_grad_norm(1.0)
    _loss(sdp, 1).backward()
    assert sdp.clip_grad_norm_(1e9) > 0
    opt.step()


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@world(2)
def test_wrapper_clip_after_step_or_twice_raises(norm_type: float) -> None:
    m = _model()
    sdp, opt = _wrap(m)
    with pytest.raises(RuntimeError, match="found no gradient to clip"):
        sdp.clip_grad_norm_(1.0, norm_type)  # before any backward
    for step in range(2):
        opt.zero_grad()
        _loss(sdp, step).backward()
        assert sdp.clip_grad_norm_(1.0, norm_type) > 0
        with pytest.raises(RuntimeError, match="already called on these gradients"):
            sdp.clip_grad_norm_(1.0, norm_type)
        with pytest.raises(RuntimeError, match="already called on these gradients"):
            opt.clip_grad_norm(1.0, norm_type)
        opt.step()
        with pytest.raises(RuntimeError, match="found no gradient to clip"):
            sdp.clip_grad_norm_(1.0, norm_type)
        with pytest.raises(RuntimeError, match="found no gradient to clip"):
            opt.clip_grad_norm(1.0, norm_type)
    # Another backward after a clip: the bucket holds new gradients, which may be clipped.
    _loss(sdp, 5).backward()
    sdp.clip_grad_norm_(1.0, norm_type)
    _loss(sdp, 6).backward()
    sdp.clip_grad_norm_(1.0, norm_type)
    opt.step()


@world(2)
def test_clip_when_ranks_disagree_raises_on_every_rank() -> None:
    """Rank 1 consumes its gradients without the collective step (zero_grad is local): the
    clip's one all-reduce still matches on both ranks and both raise."""
    m = _model()
    sdp, opt = _wrap(m)
    _loss(sdp, 0).backward()
    if dist.get_rank() == 1:
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="ranks disagree: 1 of 2 ranks have gradients"):
        sdp.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="ranks disagree: 1 of 2 ranks have gradients"):
        sdp.clip_grad_norm_(1.0, math.inf)


def _is_plain(copy_m: nn.Module) -> None:
    for sub in copy_m.modules():
        assert "__deepcopy__" not in vars(sub)
        assert not sub._forward_pre_hooks and not sub._state_dict_pre_hooks
        assert not sub._load_state_dict_pre_hooks
    for p in copy_m.parameters():
        assert p.grad is None
        # its own storage, not the bucket's flat buffer
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()


@pytest.mark.parametrize("overlap", [False, True])
@world(2)
def test_deepcopy_of_wrapped_module_is_plain_and_trains_alone(overlap: bool) -> None:
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.SGD(ref_m.parameters(), lr=0.5, momentum=0.9)
    sdp, opt = _wrap(m, overlap_param_gather=overlap)
    first = copy.deepcopy(m)  # right after wrapping
    _is_plain(first)
    for a, b in zip(ref_m.parameters(), first.parameters(), strict=True):
        assert torch.equal(a, b)
    for step in range(2):
        for model, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
    stats = dict(sdp.comm_stats.calls)
    late = copy.deepcopy(m)  # after a step: with overlap, the gathers are still in flight
    _is_plain(late)
    for a, b in zip(ref_m.parameters(), late.parameters(), strict=True):
        assert torch.equal(a, b)
    # The copy trains alone with a plain optimizer (no collective, no sharding)...
    plain = _model()
    plain.load_state_dict(late.state_dict())
    for model in (late, plain):
        o = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            o.zero_grad()
            _loss(model, 10 + step).backward()
            o.step()
    for a, b in zip(plain.parameters(), late.parameters(), strict=True):
        assert torch.equal(a, b)
    assert dict(sdp.comm_stats.calls) == stats
    # ...and the original keeps training like DDP.
    for model, o in ((ref, ref_opt), (sdp, opt)):
        o.zero_grad()
        _loss(model, 2).backward()
        o.step()
    sdp.wait_params()
    for a, b in zip(ref_m.parameters(), sdp.parameters(), strict=True):
        assert torch.equal(a, b)
    # A submodule alone copies the same way; the wrapper itself refuses, naming the way.
    _is_plain(copy.deepcopy(m[2]))
    with pytest.raises(TypeError, match=r"copy.deepcopy\(ddp.module\)"):
        copy.deepcopy(sdp)
