"""The cache-blocked local step: bit-for-bit equal to the whole-param step, or not taken."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.optim import ShardedOptimizer, _blocked
from shardkit.optim._blocked import _BlockedStepper
from shardkit.optim._torch_compat import _has_step_hooks
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_pre_hook

_CASES: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.01}),
    (torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5}),
    (torch.optim.Adamax, {"lr": 0.01}),
    (torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.RAdam, {"lr": 0.01}),
    (torch.optim.Adadelta, {"lr": 1.0}),
]


def _compare(
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    shapes: list[tuple[int, ...]],
    block_bytes: int,
    steps: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> int:
    """Steps two copies, plain and blocked; asserts bit equality; returns blocked step count."""
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    ref = [b.clone().requires_grad_(True) for b in base]
    blk = [b.clone().requires_grad_(True) for b in base]
    ref_opt = cls(ref, **kwargs)
    blk_opt = cls(blk, **kwargs)
    stepper = _BlockedStepper(block_bytes)
    blocked = 0
    for _ in range(steps):
        for r, b in zip(ref, blk, strict=True):
            g = torch.randn(r.shape, generator=gen).to(dtype)
            r.grad, b.grad = g.clone(), g.clone()
        ref_opt.step()
        if stepper.step(blk_opt, [blk]):
            blocked += 1
        else:
            blk_opt.step()
    for i, (r, b) in enumerate(zip(ref, blk, strict=True)):
        assert torch.equal(r, b), f"param {i}: max diff {(r - b).abs().max().item()}"
        assert ref_opt.state[r].keys() == blk_opt.state[b].keys()
        for k, v in ref_opt.state[r].items():
            w = blk_opt.state[b][k]
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, w), f"param {i} state {k!r} differs"
            else:
                assert v == w, f"param {i} state {k!r}: {v!r} != {w!r}"
    return blocked


@pytest.mark.parametrize("cls,kwargs", _CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_blocked_equals_whole_param_step(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    # 1024-float blocks: the big params are cut into several slices, with a short last one.
    blocked = _compare(cls, kwargs, [(70, 33), (5000,), (17,), (1024,)], 4096, steps=5)
    first_step_needs_state = cls is not torch.optim.Adagrad  # Adagrad creates state up front
    assert blocked == (4 if first_step_needs_state else 5)


@settings(max_examples=30)
@given(
    case=st.sampled_from(_CASES),
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
    block_elems=st.sampled_from([64, 128, 640, 1024]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_blocked_equality_property(
    case: tuple[type[torch.optim.Optimizer], dict[str, Any]],
    sizes: list[int],
    block_elems: int,
    dtype: torch.dtype,
    threads: int,
    seed: int,
) -> None:
    cls, kwargs = case
    block_bytes = block_elems * torch.empty((), dtype=dtype).element_size()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare(cls, kwargs, [(n,) for n in sizes], block_bytes, steps=3, dtype=dtype, seed=seed)
    finally:
        torch.set_num_threads(old)


class _Rebinding(torch.optim.Optimizer):
    """Element-wise, but rebinds its state tensors instead of updating them in place."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["avg"] = torch.zeros_like(p)
                    st["count"] = torch.zeros(())
                st["avg"] = st["avg"] * 0.9 + p.grad  # a new tensor every step
                st["count"] = st["count"] + 1
                st["calls"] = st.get("calls", 0) + 1  # a plain int, rebound too
                p.add_(st["avg"], alpha=-group["lr"] / float(st["count"]) / st["calls"] ** 0.5)
        return None


class _NotElementwise(torch.optim.Optimizer):
    """Normalises each update by the norm of the whole gradient: slicing would change it."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["buf"] = torch.zeros_like(p)
                st["buf"].mul_(0.5).add_(p.grad / p.grad.norm())
                p.add_(st["buf"], alpha=-group["lr"])
        return None


def test_rebound_state_is_copied_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_blocked, "_ELEMENTWISE", frozenset({_Rebinding}))
    monkeypatch.setattr(_blocked, "_PROBE_RESULTS", {})
    assert _compare(_Rebinding, {"lr": 0.1}, [(3000,), (10,)], 4096, steps=4) == 3


def test_probe_refuses_a_non_elementwise_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    # Even if an optimizer were wrongly allow-listed, the probe catches the difference and the
    # whole-param step runs: the result stays exact.
    monkeypatch.setattr(_blocked, "_ELEMENTWISE", frozenset({_NotElementwise}))
    monkeypatch.setattr(_blocked, "_PROBE_RESULTS", {})
    assert _compare(_NotElementwise, {"lr": 0.1}, [(3000,)], 4096, steps=3) == 0
    assert list(_blocked._PROBE_RESULTS.values()) == [False]


def test_scalar_state_changed_between_steps_reaches_every_slice() -> None:
    """Scalars are shared out from the real state on every step (e.g. after a manual edit)."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(5000, generator=gen)
    ref, blk = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    ref_opt, blk_opt = torch.optim.Adam([ref], lr=0.1), torch.optim.Adam([blk], lr=0.1)
    stepper = _BlockedStepper(4096)
    for i in range(5):
        g = torch.randn(5000, generator=gen)
        ref.grad, blk.grad = g.clone(), g.clone()
        if i == 3:  # e.g. a resumed run that rewrote the step counters
            ref_opt.state[ref]["step"].fill_(100.0)
            blk_opt.state[blk]["step"].fill_(100.0)
        ref_opt.step()
        if i == 0:
            blk_opt.step()
        else:
            assert stepper.step(blk_opt, [[blk]])
    assert torch.equal(ref, blk)
    assert torch.equal(ref_opt.state[ref]["step"], blk_opt.state[blk]["step"])
    assert float(blk_opt.state[blk]["step"]) == 102.0


def test_not_taken_when_it_cannot_pay_or_is_not_safe() -> None:
    p = torch.randn(5000, requires_grad=True)
    opt = torch.optim.Adam([p], lr=0.1)
    stepper = _BlockedStepper(4096)
    p.grad = torch.randn(5000)
    assert not stepper.step(opt, [[p]])  # no state yet: the first step creates it
    opt.step()
    small = _BlockedStepper(1 << 20)
    assert not small.step(opt, [[p]])  # fits in one block: nothing to gain
    p.grad = torch.randn(10000)[::2]  # non-contiguous gradient
    assert not stepper.step(opt, [[p]])
    p.grad = torch.randn(5000)
    assert not _BlockedStepper(4096).step(torch.optim.Adam([p], lr=0.1, differentiable=True), [[p]])
    custom = torch.optim.Adam([p], lr=0.1)

    class _MyAdam(torch.optim.Adam):
        pass

    mine = _MyAdam([p], lr=0.1)
    mine.step()
    assert not stepper.step(mine, [[p]])  # subclasses may override step(): not allow-listed
    custom.step()
    assert stepper.step(custom, [[p]])


def test_step_hooks_are_detected() -> None:
    """Pins the torch internals ``_torch_compat._has_step_hooks`` reads."""
    p = torch.randn(5000, requires_grad=True)
    opt = torch.optim.Adam([p], lr=0.1)
    assert not _has_step_hooks(opt)
    handle = opt.register_step_pre_hook(lambda o, a, k: None)
    assert _has_step_hooks(opt)
    handle.remove()
    handle = opt.register_step_post_hook(lambda o, a, k: None)
    assert _has_step_hooks(opt)
    handle.remove()
    handle = register_optimizer_step_pre_hook(lambda o, a, k: None)
    try:
        assert _has_step_hooks(opt)
        p.grad = torch.randn(5000)
        opt.step()
        assert not _BlockedStepper(4096).step(opt, [[p]])
    finally:
        handle.remove()
    assert not _has_step_hooks(opt)


@pytest.mark.parametrize("bad", [0, 4095, -1, 1.5, "1M", True])
def test_step_block_bytes_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="step_block_bytes must be an int >= 4096"):
        _blocked._check_block_bytes(bad)


def _big_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 3)
    )


@pytest.mark.parametrize(
    "cls,kwargs", [_CASES[0], _CASES[4], _CASES[9]], ids=lambda v: getattr(v, "__name__", "")
)
@world(2)
def test_sharded_blocked_parity_with_ddp(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    """DDP + plain optimizer vs ShardedOptimizer stepping 1024-float slices, bit for bit."""
    ref_model = _big_model()
    model = copy.deepcopy(ref_model)
    ref, ddp = DDP(ref_model), DDP(model)
    ref_opt = cls(ref_model.parameters(), **kwargs)
    opt = ShardedOptimizer(model.parameters(), optim=cls, step_block_bytes=4096, **kwargs)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (ref_opt, opt)]
    blocked_calls = 0
    original = opt._blocked.step  # type: ignore[union-attr]

    def counting(*args: Any, **kw: Any) -> bool:
        nonlocal blocked_calls
        taken = original(*args, **kw)
        blocked_calls += int(taken)
        return taken

    opt._blocked.step = counting  # type: ignore[union-attr, method-assign]
    for s in range(5):
        g = torch.Generator().manual_seed(100 * s + dist.get_rank())
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 3, generator=g)
        for net, o in ((ref, ref_opt), (ddp, opt)):
            o.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            o.step()
        for sch in scheds:
            sch.step()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max().item()}"
    owns_big = any(p.numel() > 1024 for p in opt.owned_params)
    assert blocked_calls == (4 if owns_big else 0)
    # state_dict round trip stays in plain torch format after blocked steps
    opt.consolidate_state_dict(0)
    if dist.get_rank() == 0:
        sd = opt.state_dict()
        ref_sd = ref_opt.state_dict()
        for i, st in ref_sd["state"].items():
            for k, v in st.items():
                assert torch.equal(v, sd["state"][i][k]), (i, k)
