"""``gradient_as_bucket_view=True``: backward accumulates into the staging buffers (issue 27).

Same bits as the default (the staging copy) in every path, and the copies are really gone:
the multiply-copies into staging (``aten.mul.out``) are counted in one backward with a
``TorchDispatchMode``. Parity with DDP over optimizers, unused params and accumulation is in
``tests-integration/test_unused_parity.py`` (mode ``zero2_views``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import captured_logs, world
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class _CountMulOut(TorchDispatchMode):
    """Counts ``aten.mul.out`` (a multiply-copy) and ``aten.mul_`` (an in-place scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.mul_out = 0
        self.mul_ = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.mul.out:
            self.mul_out += 1
        elif func is torch.ops.aten.mul_.Scalar or func is torch.ops.aten.mul_.Tensor:
            self.mul_ += 1
        return func(*args, **(kwargs or {}))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _wrap(net: nn.Module, views: bool, **kw: Any) -> tuple[ShardedDataParallel, ShardedOptimizer]:
    opt = ShardedOptimizer(net.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    return ShardedDataParallel(net, opt, gradient_as_bucket_view=views, **kw), opt


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


@world(2)
def test_backward_writes_into_the_buckets_with_the_same_bits() -> None:
    base = _net()
    runs = {}
    for views in (False, True):
        sdp, opt = _wrap(copy.deepcopy(base), views)
        counts = []
        for step in range(3):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(sdp(x), y)
            with _CountMulOut() as c:
                loss.backward()
            counts.append((c.mul_out, c.mul_))
            opt.step()
            opt.zero_grad()
        runs[views] = ([p.detach().clone() for p in sdp.parameters()], counts)
    n = len(list(base.parameters()))
    # default: every param multiply-copied into staging; views: only the backward's first
    # gradient (its pass has not begun when it arrives), every other one scaled in place
    assert all(c == (n, 0) for c in runs[False][1]), runs[False][1]
    assert all(c == (1, n - 1) for c in runs[True][1]), runs[True][1]
    for a, b in zip(runs[False][0], runs[True][0], strict=True):
        assert torch.equal(a, b)


@world(2)
def test_fallbacks_are_copies_with_the_same_bits() -> None:
    """no_sync accumulation, create_graph=True and a reduce dtype go through the copy."""
    base = _net()
    for kw, logged in (({}, False), ({"reduce_dtype": torch.float16}, True)):
        results = []
        for views in (False, True):
            sdp, opt = _wrap(copy.deepcopy(base), views, **kw)
            with captured_logs("shardkit.optim") as logs:
                for step in range(3):
                    x, y = _batch(step)
                    if step > 0:
                        with sdp.no_sync():
                            nn.functional.mse_loss(sdp(x), y).backward()
                    loss = nn.functional.mse_loss(sdp(x), y)
                    loss.backward(create_graph=step == 1)
                    opt.step()
                    opt.zero_grad()
            if views:
                assert bool(logs.matching("reduced in torch.float16")) == logged, logs.messages()
            results.append([p.detach().clone() for p in sdp.parameters()])
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)


@world(2)
def test_memory_is_the_default_pool() -> None:
    held = []
    for views in (False, True):
        sdp, opt = _wrap(_net(), views)
        x, y = _batch(0)
        nn.functional.mse_loss(sdp(x), y).backward()
        opt.step()
        held.append(sdp.memory_bytes()["staging"])  # kept: see [Note: Staging lifetime]
    assert held[0] == held[1] > 0


@world(1)
def test_flag_must_be_a_bool() -> None:
    net = nn.Linear(2, 2)
    opt = ShardedOptimizer(net.parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="gradient_as_bucket_view must be a bool, got str: 'yes'"):
        ShardedDataParallel(net, opt, gradient_as_bucket_view="yes")  # type: ignore[arg-type]
