"""The compiled compact step (``_compact_fused.py``) against the eager one, byte for byte.

``compact_adam_step(compiled=True)`` must leave the same bytes as ``compiled=False`` (params,
masters, remainders, codes, scale bits, step counts) for every option: int8 / int4, amsgrad,
maximize, Adam's and AdamW's weight decay, single / foreach / fused, fp32 params, bf16 / fp16
params with fp32 masters, bf16 params with int16 remainders, gradient factors (the last three
through the library's path of master weights, ``_master_set.py``, around the step), edge shapes
(``()``, ``(1,)``, 0-size, a few elements, a block cut short, more than one compiled chunk) and
special values (inf, NaN, signed zeros, subnormals). A second step must not compile again, a
failed compilation must fall back to the eager step (logged once), and ``compiled=False``
(``ShardedOptimizer(compact_compile=False)``) must not compile at all. Under ZeRO-2
(shardkit-ddp's ShardedDataParallel at world 2 and 3), where each rank steps its pieces of the
flat buckets with the default short-tail hand-over, the compiled and eager runs in the same
ranks end with the same bytes.

The variants compiled here are few (each costs seconds, once per process): the structural
options (formats, amsgrad, masters / remainders) are parametrized, everything else is drawn.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _compact_testkit import masters_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardkit.optim import ShardedOptimizer
from shardkit.optim import _compact_fused as fused
from shardkit.optim._compact import CompactTensor
from shardkit.optim._compact_optim import compact_class
from shardkit.optim._compact_step import AdamState, StepScratch, compact_adam_step
from shardkit.optim._remainder import split_master
from shardkit.testing import world

_SETTINGS = settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
_SHAPES = [(), (1,), (0,), (7,), (4096,), (4097,), (64, 70), (3, 1500), (fused.FUSED_CHUNK + 300,)]
_IMPLS = ["single", "foreach", "fused"]
_EAGER_BELOW = fused.EAGER_BELOW


@pytest.fixture(autouse=True)
def _compile_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk through the compiled kernels, short and padded ones included (by default
    a short last chunk steps eagerly: [Note: Short tails step eagerly]); the tests that check
    the default set it back."""
    monkeypatch.setattr(fused, "EAGER_BELOW", 0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (NaN payloads and signed zeros included)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _same_state(a: AdamState, b: AdamState) -> None:
    assert torch.equal(a.step, b.step)
    for (name, x), (_, y) in zip(a.moments(), b.moments(), strict=True):
        if isinstance(x, CompactTensor):
            assert isinstance(y, CompactTensor) and x.equal(y), name
        else:
            assert isinstance(y, torch.Tensor) and torch.equal(_bits(x), _bits(y)), name


def _setup(
    shapes: list[tuple[int, ...]], kinds: list[str | None], how: str, dtype: torch.dtype,
    amsgrad: bool, impl: str, seed: int,
) -> dict[str, Any]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    fp32 = [torch.randn(s, generator=g) for s in shapes]
    out: dict[str, Any] = {"masters": None, "remainders": None}
    if how == "plain":
        out["params"] = fp32
    elif how == "master":
        out["params"] = [m.to(dtype) for m in fp32]
        out["masters"] = [m.clone() for m in fp32]
    else:
        splits = [split_master(m) for m in fp32]
        out["params"] = [p for p, _ in splits]
        out["remainders"] = [r for _, r in splits]
    out["states"] = [
        AdamState.zeros(m, k, amsgrad=amsgrad, fused=impl == "fused")
        for m, k in zip(fp32, kinds, strict=True)
    ]
    return out


def _clone(run: dict[str, Any]) -> dict[str, Any]:
    def c(xs: list[Any] | None) -> list[Any] | None:
        return None if xs is None else [x.clone() for x in xs]

    states = [
        AdamState(
            s.step.clone(),
            *(m.clone() for _, m in s.moments()[:2]),
            None if s.max_exp_avg_sq is None else s.max_exp_avg_sq.clone(),
        )
        for s in run["states"]
    ]
    return {
        "params": c(run["params"]),
        "masters": c(run["masters"]),
        "remainders": c(run["remainders"]),
        "states": states,
    }


def _step_both(
    run: dict[str, Any], grads: list[torch.Tensor | None], **kw: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One step of a copy with the eager step and one with the compiled step."""
    eager, compiled = _clone(run), _clone(run)
    for r, flag in ((eager, False), (compiled, True)):
        if r["masters"] is None and r["remainders"] is None:
            compact_adam_step(
                r["params"], grads, r["states"], compiled=flag, scratch=StepScratch(), **kw
            )
        else:  # bf16 / fp16 params: the library's masters around the step of fp32 masters
            r["masters"], r["remainders"] = masters_step(
                r["params"], grads, r["states"], masters=r["masters"],
                remainders=r["remainders"], compiled=flag, scratch=StepScratch(), **kw,
            )  # fmt: skip
    return eager, compiled


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("params", "masters", "remainders"):
        if a[key] is not None:
            for i, (x, y) in enumerate(zip(a[key], b[key], strict=True)):
                assert torch.equal(_bits(x), _bits(y)), (key, i, tuple(x.shape))
    for x, y in zip(a["states"], b["states"], strict=True):
        _same_state(x, y)


def _grads(
    shapes: list[tuple[int, ...]], g: torch.Generator, dtype: torch.dtype, p_unused: float
) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for s in shapes:
        used = torch.rand((), generator=g).item() >= p_unused
        scale = 10.0 ** torch.randint(-4, 2, (), generator=g).item()
        out.append((torch.randn(s, generator=g) * scale).to(dtype) if used else None)
    return out


@pytest.mark.parametrize(("kind", "amsgrad"), [("int8", False), ("int4", True)])
@_SETTINGS
@given(
    shapes=st.lists(st.sampled_from(_SHAPES), min_size=1, max_size=3),
    impl=st.sampled_from(_IMPLS),
    adamw=st.booleans(),
    maximize=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.1]),
    lr=st.sampled_from([1e-3, 0.05]),
    beta1=st.sampled_from([0.9, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_fp32_params_same_bytes(
    kind: str, amsgrad: bool, shapes: list[tuple[int, ...]], impl: str, adamw: bool,
    maximize: bool, weight_decay: float, lr: float, beta1: float, seed: int,
) -> None:  # fmt: skip
    run = _setup(shapes, [kind] * len(shapes), "plain", torch.float32, amsgrad, impl, seed)
    g = torch.Generator().manual_seed(seed + 1)
    hp = dict(
        lr=lr, betas=(beta1, 0.99), eps=1e-8, weight_decay=weight_decay, amsgrad=amsgrad,
        maximize=maximize, decoupled_weight_decay=adamw, impl=impl,
    )  # fmt: skip
    for _ in range(3):
        eager, compiled = _step_both(run, _grads(shapes, g, torch.float32, 0.2), **hp)
        _assert_same(eager, compiled)
        run = eager


@pytest.mark.parametrize("impl", _IMPLS)
@pytest.mark.parametrize(
    ("how", "dtype", "kinds", "n_factors"),
    [
        ("master", torch.bfloat16, ["int8", "int4", None], 2),
        ("master", torch.float16, ["int8", "int4", None], 1),
        ("remainder", torch.bfloat16, ["int8", "int4", None], 0),
    ],
)
def test_masters_remainders_and_factors_same_bytes(
    impl: str, how: str, dtype: torch.dtype, kinds: list[str | None], n_factors: int
) -> None:
    shapes = [(70, 100), (4097,), (33,)]
    run = _setup(shapes, kinds, how, dtype, False, impl, seed=4)
    factors = [torch.tensor(1 / 1024.0), torch.tensor(0.37)][:n_factors]
    g = torch.Generator().manual_seed(5)
    hp = dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False,
        maximize=False, decoupled_weight_decay=True, impl=impl, grad_factors=factors,
    )  # fmt: skip
    for _ in range(3):
        eager, compiled = _step_both(run, _grads(shapes, g, dtype, 0.2), **hp)
        _assert_same(eager, compiled)
        run = eager


def test_special_values_same_bytes() -> None:
    """inf and NaN gradients (poisoned blocks), huge and subnormal ones, signed zeros."""
    n = 3 * 256 + 5
    run = _setup([(n,)], ["int8"], "plain", torch.float32, False, "foreach", seed=6)
    run["params"][0][:10] = -0.0
    g = torch.randn(n) * 1e-3
    g[0], g[1], g[300], g[301] = torch.inf, -torch.inf, torch.nan, 1e30
    g[600:610] = 1e-42  # subnormal
    g[610:620] = -0.0
    for grads in ([g], [torch.randn(n)]):
        eager, compiled = _step_both(
            run, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
            amsgrad=False, maximize=False, decoupled_weight_decay=False, impl="foreach",
        )  # fmt: skip
        _assert_same(eager, compiled)
        run = eager
    assert torch.isnan(run["params"][0]).any()  # the poisoned blocks did poison


def test_second_step_does_not_compile() -> None:
    """A new learning rate, step count, param length and padded chunk reuse the kernels."""
    kw = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True)
    p = torch.randn(fused.FUSED_CHUNK + 1000)
    st_ = AdamState.zeros(p, "int8")
    compact_adam_step([p], [torch.randn_like(p)], [st_], lr=1e-3, compiled=True, **kw)
    assert fused.compiled_unavailable() is None
    misses = fused._compiled.cache_info().misses
    q = torch.randn(3 * fused.FUSED_CHUNK - 4096)
    sq = AdamState.zeros(q, "int8")
    with torch.compiler.set_stance("fail_on_recompile"):
        for lr in (2e-3, 5e-4):
            compact_adam_step(
                [p, q], [torch.randn_like(p), torch.randn_like(q)], [st_, sq], lr=lr,
                compiled=True, **kw,
            )  # fmt: skip
    assert fused._compiled.cache_info().misses == misses
    assert st_.step.item() == 3


def test_failed_compilation_falls_back_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("no C++ compiler here")

    def kernels(variant: Any) -> tuple[Callable[..., None], Callable[..., None]]:
        return broken, broken

    monkeypatch.setattr(fused, "_compiled", kernels)
    monkeypatch.setitem(fused._state, "unavailable", None)
    run = _setup([(5000,), (300,)], ["int8", "int8"], "plain", torch.float32, False, "foreach", 7)
    g = torch.Generator().manual_seed(8)
    with caplog.at_level(logging.WARNING, logger="shardkit.optim"):
        for _ in range(2):
            eager, compiled = _step_both(
                run, _grads([(5000,), (300,)], g, torch.float32, 0.0), lr=1e-3
            )
            _assert_same(eager, compiled)
            run = eager
    logged = [r for r in caplog.records if "compiled step is unavailable" in r.getMessage()]
    assert len(logged) == 1 and "no C++ compiler here" in logged[0].getMessage()
    assert fused.compiled_unavailable() is not None


def test_compiled_false_never_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(variant: Any) -> Any:
        raise AssertionError("compiled although compilation is off")

    monkeypatch.setattr(fused, "_compiled", refuse)
    w = torch.nn.Parameter(torch.randn(64, 80))
    opt = compact_class(torch.optim.AdamW, "int8", compiled=False)([w], lr=1e-3)
    w.grad = torch.randn_like(w)
    opt.step()
    assert isinstance(opt.state[w]["exp_avg"], CompactTensor)
    on = compact_class(torch.optim.AdamW, "int8")([w], lr=1e-3)
    assert type(on).compiled_step and not type(opt).compiled_step  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="compact_compile must be a bool"):
        ShardedOptimizer([w], torch.optim.AdamW, compact_state="int8", compact_compile="no")  # type: ignore[arg-type]


def test_importing_compiles_nothing() -> None:
    """No dynamo, no inductor until a compact step runs compiled."""
    code = (
        "import sys, torch, shardkit.optim\n"
        "print(any(m.startswith(('torch._dynamo', 'torch._inductor')) for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_compile_options_pin() -> None:
    """The inductor options the bytes rely on exist in this torch and are set as stated."""
    import torch._inductor

    known = set(torch._inductor.list_options())
    assert set(fused.COMPILE_OPTIONS) <= known
    assert fused.COMPILE_OPTIONS["cpp.enable_floating_point_contract_flag"] == "off"
    assert fused.COMPILE_OPTIONS["cpp.enable_unsafe_math_opt_flag"] is False


def test_active_function_mode_does_not_recompile() -> None:
    """A torch-function mode on the stack whose state changes per call (as shardkit-ddp's
    param-access guard counts its calls) neither recompiles the kernels nor sees their ops;
    torch's Adam between them still runs through it."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.calls += 1
            return func(*args, **(kwargs or {}))

    p = torch.randn(2 * fused.FUSED_CHUNK + 5000)
    st_ = AdamState.zeros(p, "int8")
    compact_adam_step([p], [torch.randn_like(p)], [st_], lr=1e-3, compiled=True)
    mode = Count()
    with mode, torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(3):
            compact_adam_step([p], [torch.randn_like(p)], [st_], lr=1e-3, compiled=True)
    assert mode.calls > 0 and fused.compiled_unavailable() is None


@pytest.mark.parametrize("failing", ["dequantize", "quantize"])
@pytest.mark.parametrize("how", ["plain", "remainder"])
def test_failure_after_a_chunk_continues_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failing: str, how: str
) -> None:
    """A compilation that fails at a later chunk (a recompilation refused, ...), in either
    kernel: the chunks already stepped stay, the failed one and the rest end eagerly, same
    bytes."""
    real = fused._compiled
    calls = {"n": 0}
    kernels_of: dict[str, Callable[..., None]] = {}

    def kernels(variant: Any) -> tuple[Callable[..., None], Callable[..., None]]:
        dequantize, quantize = real(variant)
        kernels_of["dequantize"] = dequantize

        def flaky(*args: Any) -> None:
            calls["n"] += 1
            if calls["n"] > 1:
                raise RuntimeError("recompilation refused")
            dequantize(*args)

        def flaky_quantize(*args: Any) -> None:
            if failing == "quantize" and calls["n"] > 1:
                raise RuntimeError("recompilation refused")
            quantize(*args)

        return (flaky if failing == "dequantize" else counted), flaky_quantize

    def counted(*args: Any) -> None:
        calls["n"] += 1
        kernels_of["dequantize"](*args)

    monkeypatch.setattr(fused, "_compiled", kernels)
    monkeypatch.setitem(fused._state, "unavailable", None)
    shapes = [(2 * fused.FUSED_CHUNK + 700,)]
    dtype = torch.float32 if how == "plain" else torch.bfloat16
    run = _setup(shapes, ["int8"], how, dtype, False, "fused", 9)
    g = torch.Generator().manual_seed(10)
    with caplog.at_level(logging.WARNING, logger="shardkit.optim"):
        eager, compiled = _step_both(run, _grads(shapes, g, dtype, 0.0), lr=1e-3, impl="fused")
    _assert_same(eager, compiled)
    assert calls["n"] == 2 and "recompilation refused" in caplog.text


def _counting(
    real: Callable[[Any], tuple[Callable[..., None], Callable[..., None]]], chunks: dict[str, int]
) -> Callable[[Any], tuple[Callable[..., None], Callable[..., None]]]:
    """``real`` (``fused._compiled``) whose dequantize kernel counts its calls (one per
    compiled chunk) in ``chunks["n"]``."""

    def kernels(variant: Any) -> tuple[Callable[..., None], Callable[..., None]]:
        dequantize, quantize = real(variant)

        def counted(*args: Any) -> None:
            chunks["n"] += 1
            dequantize(*args)

        return counted, quantize

    return kernels


@pytest.mark.parametrize("how", ["plain", "remainder"])
def test_short_tails_step_eagerly(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """By default a last chunk shorter than ``EAGER_BELOW``, or a param shorter than that,
    never reaches the compiled kernels; the eager step continues from the last full chunk,
    batched across params, with the same bytes as the eager step alone."""
    monkeypatch.setattr(fused, "EAGER_BELOW", _EAGER_BELOW)
    real = fused._compiled
    chunks = {"n": 0}
    kernels = _counting(real, chunks)
    monkeypatch.setattr(fused, "_compiled", kernels)
    c, e = fused.FUSED_CHUNK, _EAGER_BELOW
    # full chunks + a short tail (eager) | short params (eager) | a tail of exactly
    # EAGER_BELOW (compiled, padded) | exactly one chunk
    shapes = [(c + 300,), (1000,), (e - 1,), (2 * c + e,), (c,), ()]
    expected = 1 + 0 + 0 + 3 + 1 + 0
    dtype = torch.float32 if how == "plain" else torch.bfloat16
    run = _setup(shapes, ["int8", "int4", "int8", "int4", "int8", "int8"], how, dtype, False,
                 "fused", 11)  # fmt: skip
    g = torch.Generator().manual_seed(12)
    for _ in range(2):
        chunks["n"] = 0
        eager, compiled = _step_both(
            run, _grads(shapes, g, dtype, 0.0), lr=1e-3, weight_decay=0.01,
            decoupled_weight_decay=True, impl="fused",
        )  # fmt: skip
        _assert_same(eager, compiled)
        assert chunks["n"] == expected
        run = compiled
    assert fused.compiled_unavailable() is None


def _big_model(dtype: torch.dtype) -> torch.nn.Module:
    """Two weights of 1 Mi and 400 Ki elements (compact, each rank's pieces of them long
    enough for the compiled kernels: whole chunks, padded chunks and short eager tails,
    depending on the world size) and small full-precision params."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 400),
        torch.nn.Tanh(), torch.nn.Linear(400, 3),
    )  # fmt: skip
    return m.to(dtype)


_ZERO2_CASES = [
    ("int8", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}, False),
    ("int4", torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "foreach": True}, True),
]


def _zero2_same_bytes(case: int) -> None:
    """ShardedDataParallel (ZeRO-2: each rank steps its pieces of the flat buckets) with the
    default compiled step and with ``compact_compile=False``, side by side in the same ranks:
    the same losses, params and sharded optimizer state to the last bit after 3 steps, and
    the compiled kernels stepped chunks on every rank."""
    from shardkit.ddp import ShardedDataParallel

    kind, cls, kw, masters = _ZERO2_CASES[case]
    dtype = torch.bfloat16 if masters else torch.float32
    real = fused._compiled
    chunks = {"n": 0}
    kernels = _counting(real, chunks)
    fused._compiled = kernels  # type: ignore[assignment]
    try:
        runs = []
        for compiled in (False, True):
            m = _big_model(dtype)
            opt = ShardedOptimizer(
                m.parameters(), cls, compact_state=kind, compact_compile=compiled,
                master_dtype=torch.float32 if masters else None, **kw,
            )  # fmt: skip
            runs.append((m, ShardedDataParallel(m, opt), opt))
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            x, y = torch.randn(16, 1024, generator=g), torch.randn(16, 3, generator=g)
            losses = []
            for _, sdp, opt in runs:
                opt.zero_grad()
                out = torch.nn.functional.mse_loss(sdp(x.to(dtype)).float(), y)
                out.backward()
                opt.step()
                losses.append(_bits(out))
            assert torch.equal(losses[0], losses[1])
        for _, sdp, _ in runs:
            sdp.wait_params()
    finally:
        fused._compiled = real  # type: ignore[assignment]
    assert chunks["n"] > 0 and fused.compiled_unavailable() is None
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        assert torch.equal(_bits(a), _bits(b))
    want, got = (opt.state_dict(all_ranks=True)["state"] for _, _, opt in runs)
    assert want.keys() == got.keys()
    for i, state in want.items():
        for k, v in state.items():
            w, h = v, got[i][k]
            assert torch.equal(_bits(w), _bits(h)) if torch.is_tensor(w) else w == h, (i, k)


@pytest.mark.parametrize("case", range(len(_ZERO2_CASES)))
@world(2)
def test_zero2_compiled_step_same_bytes_world2(case: int) -> None:
    """See :func:`_zero2_same_bytes` (world 2)."""
    _zero2_same_bytes(case)


@pytest.mark.parametrize("case", range(len(_ZERO2_CASES)))
@world(3)
def test_zero2_compiled_step_same_bytes_world3(case: int) -> None:
    """See :func:`_zero2_same_bytes` (world 3: other cuts of the weights between ranks)."""
    _zero2_same_bytes(case)
