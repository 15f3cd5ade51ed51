"""The one-kernel compact step (``_compact_kernel.py``) against the eager one, within its
stated tolerance ([Note: One kernel on a GPU]).

The kernel runs on GPUs (``KERNEL_DEVICES``); here it is pointed at the CPU, where inductor
compiles the same graph to C++, so its math, padding, hand-over and compilation behaviour are
checked without a GPU (``tests/test_gpu.py`` checks it on CUDA where one is visible). From the
same state, one step each: params within 4 ulps of the larger of the param and the learning
rate; scales within 4 ulps (of either sign: where a block's largest and smallest values are
within an ulp of each other's magnitude, either can be its signed extreme); dequantized moments
within one gap of the map (a code off by one where the fp32 moment sits on a threshold), codes
different on under 1 % of the elements; NaN where the eager step has NaN.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from _compact_testkit import assert_close_step, groups, loss, model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.optim import _compact_fused as fused
from shardkit.optim import _compact_kernel as kernel
from shardkit.optim import _compact_step as step_mod
from shardkit.optim._compact import CompactTensor
from shardkit.optim._compact_step import AdamState, compact_adam_step
from shardkit.testing import world

_SETTINGS = settings(
    max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
_SHAPES = [(), (1,), (0,), (7,), (4096,), (4097,), (64, 70), (fused.FUSED_CHUNK + 300,)]


@pytest.fixture(autouse=True)
def _kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "KERNEL_DEVICES", frozenset({"cpu"}))


def _run(
    shape: tuple[int, ...], kind: str, amsgrad: bool, seed: int, steps: int, **kw: Any
) -> None:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g)
    state = AdamState.zeros(p, kind if p.numel() else None, amsgrad=amsgrad)
    eager_state = AdamState.zeros(p, kind if p.numel() else None, amsgrad=amsgrad)
    for _ in range(steps):
        grad = torch.randn(shape, generator=g) * 1e-2
        pe, pk = p.clone(), p.clone()
        for (_, a), (_, b) in zip(state.moments(), eager_state.moments(), strict=True):
            if isinstance(a, CompactTensor) and isinstance(b, CompactTensor):
                b.codes.copy_(a.codes)
                b.scales.copy_(a.scales)
        eager_state.step.copy_(state.step)
        compact_adam_step([pe], [grad], [eager_state], amsgrad=amsgrad, compiled=False, **kw)
        compact_adam_step([pk], [grad], [state], amsgrad=amsgrad, compiled=True, **kw)
        if p.numel():
            assert_close_step((pe, eager_state), (pk, state), p, kw["lr"])
        p = pk
    assert fused.compiled_unavailable() is None  # the kernel stepped, not the eager fallback


@pytest.mark.parametrize(("kind", "amsgrad"), [("int8", False), ("int4", True)])
@_SETTINGS
@given(
    shape=st.sampled_from(_SHAPES),
    seed=st.integers(0, 2**16),
    lr=st.sampled_from([1e-3, 3e-2]),
    weight_decay=st.sampled_from([0.0, 0.05]),
    decoupled=st.booleans(),
    maximize=st.booleans(),
    impl=st.sampled_from(["single", "foreach", "fused"]),
)
def test_kernel_step_within_tolerance(
    kind: str, amsgrad: bool, shape: tuple[int, ...], seed: int, lr: float, weight_decay: float,
    decoupled: bool, maximize: bool, impl: str,
) -> None:  # fmt: skip
    _run(
        shape, kind, amsgrad, seed, 2, lr=lr, betas=(0.9, 0.999), eps=1e-8,
        weight_decay=weight_decay, decoupled_weight_decay=decoupled, maximize=maximize,
        impl=impl,
    )  # fmt: skip


def test_kernel_special_values() -> None:
    """A poisoned block (inf or NaN gradient) is NaN as in the eager step; huge, subnormal and
    signed-zero gradients within tolerance."""
    n = 3 * 256 + 5
    p = torch.randn(n)
    p[:10] = -0.0
    grad = torch.randn(n) * 1e-3
    grad[0], grad[1], grad[300], grad[301] = torch.inf, -torch.inf, torch.nan, 1e30
    grad[600:610] = 1e-42
    grad[610:620] = -0.0
    states = [AdamState.zeros(p, "int8") for _ in range(2)]
    ps = [p.clone(), p.clone()]
    for k, compiled in enumerate((False, True)):
        compact_adam_step([ps[k]], [grad], [states[k]], lr=1e-2, weight_decay=0.1,
                          compiled=compiled)  # fmt: skip
    assert_close_step((ps[0], states[0]), (ps[1], states[1]), p, 1e-2)
    assert torch.isnan(ps[1]).any()


def test_kernel_steps_whole_params_and_does_not_recompile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every element through the kernel (no eager tail), and a new learning rate, step count,
    param length and padded chunk reuse the compiled kernel."""
    kw = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True)
    p = torch.randn(fused.FUSED_CHUNK + 1000)
    sp = AdamState.zeros(p, "int8")
    compact_adam_step([p], [torch.randn_like(p)], [sp], lr=1e-3, compiled=True, **kw)
    assert fused.compiled_unavailable() is None
    misses = kernel._compiled.cache_info().misses
    q = torch.randn(3 * fused.FUSED_CHUNK - 4096)
    sq = AdamState.zeros(q, "int8")
    calls: list[int] = []
    original = kernel.kernel_param_step

    def counting(param: torch.Tensor, *args: Any) -> int:
        done = original(param, *args)
        calls.append(done - param.numel())
        return done

    monkeypatch.setattr(step_mod, "kernel_param_step", counting)
    with torch.compiler.set_stance("fail_on_recompile"):
        for lr in (2e-3, 5e-4):
            compact_adam_step(
                [p, q], [torch.randn_like(p), torch.randn_like(q)], [sp, sq], lr=lr,
                compiled=True, **kw,
            )  # fmt: skip
    assert kernel._compiled.cache_info().misses == misses
    assert calls == [0, 0, 0, 0]  # every element stepped by the kernel
    assert sp.step.item() == 3 and sq.step.item() == 2


def test_kernel_failure_falls_back_to_the_eager_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("no Triton here")

    monkeypatch.setattr(kernel, "_compiled", lambda variant: broken)
    monkeypatch.setitem(fused._state, "unavailable", None)
    p = torch.randn(5000)
    grad = torch.randn(5000)
    states = [AdamState.zeros(p, "int8") for _ in range(2)]
    ps = [p.clone(), p.clone()]
    with caplog.at_level(logging.WARNING, logger="shardkit.optim"):
        for _ in range(2):
            for k, compiled in enumerate((False, True)):
                compact_adam_step([ps[k]], [grad], [states[k]], lr=1e-3, compiled=compiled)
    assert torch.equal(ps[0], ps[1])  # the eager step ran: the same bytes
    for (_, a), (_, b) in zip(states[0].moments(), states[1].moments(), strict=True):
        assert isinstance(a, CompactTensor) and isinstance(b, CompactTensor) and a.equal(b)
    logged = [r for r in caplog.records if "compiled step is unavailable" in r.getMessage()]
    assert len(logged) == 1 and "no Triton here" in logged[0].getMessage()


def test_kernel_only_on_kernel_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the CPU runs the same-bytes halves, not the one kernel."""
    p = torch.randn(4096)
    moments = [m for _, m in AdamState.zeros(p, "int8").moments()]
    assert kernel.kernel_eligible(p, torch.randn_like(p), moments)
    monkeypatch.setattr(kernel, "KERNEL_DEVICES", frozenset({"cuda"}))
    assert not kernel.kernel_eligible(p, torch.randn_like(p), moments)
    assert fused.fused_eligible(p, torch.randn_like(p), moments)
    plain = [torch.zeros_like(p), torch.zeros_like(p)]
    monkeypatch.setattr(kernel, "KERNEL_DEVICES", frozenset({"cpu"}))
    assert not kernel.kernel_eligible(p, torch.randn_like(p), plain)


@pytest.mark.parametrize("masters", [False, True])
@world(2)
def test_zero2_with_the_kernel_tracks_the_eager_step(masters: bool) -> None:
    """ShardedDataParallel (ZeRO-2, each rank steps its block-aligned pieces) with int8
    moments, the kernel pointed at the CPU, against the same run with ``compact_compile=False``
    in the same ranks: the kernel steps every compact piece, and after 4 steps of AdamW at lr
    1e-2 the params agree within 1e-4 (one code gap of a moment moves an update by about
    ``lr * 0.007``; the differences start at an ulp and stay at that scale)."""
    saved = kernel.KERNEL_DEVICES
    original = step_mod.kernel_param_step
    calls: list[int] = []

    def counting(param: torch.Tensor, *args: Any) -> int:
        calls.append(param.numel())
        return original(param, *args)

    kernel.KERNEL_DEVICES = frozenset({"cpu"})
    step_mod.kernel_param_step = counting  # type: ignore[assignment]
    try:
        dtype = torch.bfloat16 if masters else torch.float32
        runs = []
        for compiled in (False, True):
            m = model(dtype)
            opt = ShardedOptimizer(
                groups(m), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, compact_state="int8",
                compact_compile=compiled, master_dtype=torch.float32 if masters else None,
            )  # fmt: skip
            runs.append((m, ShardedDataParallel(m, opt, reduce_buffer_size=6000), opt))
        for step in range(4):
            losses = []
            for _, sdp, opt in runs:
                opt.zero_grad()
                out = loss(sdp, step)
                out.backward()
                opt.step()
                losses.append(out.item())
            assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[0]), (step, losses)
        for _, sdp, _ in runs:
            sdp.wait_params()
    finally:
        kernel.KERNEL_DEVICES = saved
        step_mod.kernel_param_step = original  # type: ignore[assignment]
    assert len(calls) >= 4 and all(n > 0 for n in calls)  # the kernel stepped the pieces
    assert fused.compiled_unavailable() is None
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=1e-4)


def test_step_scalars_per_param_on_the_host_and_on_the_device() -> None:
    """[Note: Step scalars without a sync]: each param's row carries its own bias corrections;
    computed from step counts on the device (here the CPU stands in for it) they are the
    host's values (double precision both ways, rounded once to fp32)."""
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
    steps = [torch.tensor(float(s)) for s in (0, 1, 5, 1000)]
    host = kernel.kernel_hypers(steps, kw, torch.device("cpu"))
    assert host.shape == (4, 8) and host.dtype == torch.float32
    for row, s in zip(host.tolist(), (0, 1, 5, 1000), strict=True):
        t = s + 1.0
        want = [0.1, 0.999, 1 - 0.999, 1e-8, -(3e-3 / (1 - 0.9**t)), (1 - 0.999**t) ** 0.5]
        want += [1 - 3e-3 * 0.1, float(fused.FUSED_CHUNK)]
        assert row == torch.tensor(want, dtype=torch.float32).tolist()
    base = host[0].double().tolist()
    on_device = kernel._hypers_on(steps, base, 3e-3, 0.9, 0.999, torch.device("cpu"))
    assert torch.equal(on_device[:, [0, 1, 2, 3, 6, 7]], host[:, [0, 1, 2, 3, 6, 7]])
    assert bool(((on_device - host).abs() <= host.abs() * 2.0**-23).all())
