"""Compact optimizer state (issue 40, engine core): quality, bytes per param, step time.

Single process, CPU, ``torch.set_num_threads(1)``; nothing distributed (the core is not yet
wired into ``ShardedOptimizer``). Four measurements:

1. **Quality.** The demo's character-level GPT (``docs/examples/demo.py``: token and position
   embeddings, 3 pre-norm blocks of ``nn.MultiheadAttention`` + MLP, tied head; ~0.6 M params)
   trained on the demo's text (18 Shakespeare sonnets, the last 10 % held out) for
   ``SHARDKIT_BENCH_COMPACT_STEPS`` steps (default 300; batch 32 windows of 64 characters, AdamW
   lr 3e-3, weight decay 0.01) with fp32 moments (``torch.optim.AdamW``), int8 and int4 moments
   (``compact_adam_step``, params under 4096 elements full precision), seeds 0, 1, 2 (model
   init and batch order). Recorded: the final training loss (mean of the last 20 steps) and the
   held-out loss, per seed; the int8 mean should be no worse than the fp32 seeds (at most
   their maximum; whether it is within their spread is recorded too).
2. **Quality on a second model** (``test_bench_compact_quality_cnn``), so that the claim does not
   rest on one small task that overfits: a CNN (three conv layers, 5x5 / 3x3 / 3x3, max
   pooling, two linear layers; 90 K params, 98.2 % of them in params of >= 4096 elements) that
   classifies noisy sinusoidal gratings of 16 x 16 pixels into 16 classes (8 orientations x 2
   spatial frequencies; random phase and contrast, Gaussian noise of std 2, about twice the
   signal's amplitude). The images are generated once from a fixed generator (16384 to
   train on, 4096 held out), the same for every run; ``SHARDKIT_BENCH_COMPACT_CNN_STEPS``
   steps (default 400; batch 128, AdamW lr 1e-3, weight decay 0.01), the same kinds and seeds
   through the same training loop. A task still learning at the end (not saturated, not
   overfitting much). Recorded: the same figures plus the held-out accuracy.

   For both models the loss curves are recorded as data (``loss_curves`` in ``extra_info``: the
   mean training loss of each 10 steps, mean over the seeds, per kind; per run in
   ``results``).
3. **Bytes per param** of optimizer state (the moments; step counts are one scalar per param),
   on the GPT (its small params stay fp32) and on a model of large matrices only.
4. **Step time** of the optimizer step alone on 4 x ``Linear(1024, 1024)`` (4.2 M params,
   constant random gradients): the compact step (torch's foreach and fused AdamW inside; chunks
   of 64 Ki and 256 Ki elements) against ``torch.optim.AdamW(fused=True)`` and
   ``(foreach=True)``, interleaved round robin (the median of ``SHARDKIT_BENCH_COMPACT_ROUNDS``
   rounds, default 15); where the compact step's time goes (its ``shardkit.compact.*`` profiler
   ranges: dequantize, torch's Adam, quantize); the codec alone, eager and under
   ``torch.compile`` (bit-identical, asserted); and the whole training step of the GPT runs
   above (forward, backward, optimizer), int8 / int4 over fp32.

5. **The compiled step** (issue 51, ``test_bench_compact_compiled_step``): the same step time
   interleaved for fp32 AdamW, the eager compact step and ``compact_adam_step(compiled=True)``
   (int8 / int4, fused and foreach inside), and the first-step compilation cost in fresh
   processes, with an empty inductor cache and with the cache that run left.

6. **The one kernel on a GPU** (issue 51, ``test_bench_compact_kernel_cuda``, skipped without
   CUDA): the optimizer step alone on 8 x ``Linear(2048, 2048)`` (33.6 M params) on the GPU,
   ``torch.optim.AdamW(fused=True)`` against ``compact_adam_step(compiled=True)`` (one Triton
   kernel per chunk: [Note: One kernel on a GPU] in ``_compact_kernel.py``) and the eager
   compact step, int8 and int4, interleaved, CUDA-event medians, and the first call's cost.

Run with ``python -m pytest -o python_files='bench_*.py' packages/optim/benchmarks/bench_compact.py
-q -s`` (about 5 minutes on a loaded 2-core CPU, plus about 2 for the CNN and 1 for the compiled
step); ``-k cnn`` runs the CNN's quality runs alone, ``-k compiled`` the compiled step's,
``-k compact_state`` the rest.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from shardkit.optim._compact import (
    CHUNK,
    CompactTensor,
    _decode,
    _encode_rows,
    moment_formats,
    stores_compact,
)
from shardkit.optim._compact_maps import lookup_tables
from shardkit.optim._compact_step import AdamState, StepScratch, compact_adam_step
from torch import nn

_ROOT = Path(__file__).resolve().parents[3]
_STEPS = int(os.environ.get("SHARDKIT_BENCH_COMPACT_STEPS", "300"))
_CNN_STEPS = int(os.environ.get("SHARDKIT_BENCH_COMPACT_CNN_STEPS", "400"))
_ROUNDS = int(os.environ.get("SHARDKIT_BENCH_COMPACT_ROUNDS", "15"))
_SEEDS = (0, 1, 2)
_KINDS = ("fp32", "int8", "int4")
_CURVE_EVERY = 10  # steps per point of the recorded loss curves


def _demo() -> Any:
    """docs/examples/demo.py as a module (its GPT, data and text reader)."""
    spec = importlib.util.spec_from_file_location("_shardkit_demo", _ROOT / "docs/examples/demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class CompactAdamW(torch.optim.Optimizer):
    """AdamW with compact moments, for the benchmark: one ``compact_adam_step`` per group.

    Params with at least 4096 elements get ``kind`` moments, the others fp32 ones (decided on
    the whole param, as the engine will).
    """

    def __init__(
        self,
        params: Any,
        kind: str,
        impl: str = "foreach",
        chunk: int = CHUNK,
        compiled: bool = False,
        **hp: Any,
    ) -> None:
        defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
        defaults.update(hp)
        super().__init__(params, defaults)
        self.kind, self.impl, self.compiled = kind, impl, compiled
        self.scratch = StepScratch(chunk=chunk)
        self.compact: dict[torch.Tensor, AdamState] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            params = group["params"]
            for p in params:
                if p not in self.compact:
                    kind = self.kind if stores_compact(p.numel(), p.dtype) else None
                    self.compact[p] = AdamState.zeros(p, kind, fused=self.impl == "fused")
            compact_adam_step(
                params,
                [p.grad for p in params],
                [self.compact[p] for p in params],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                decoupled_weight_decay=True,
                impl=self.impl,  # type: ignore[arg-type]
                scratch=self.scratch,
                compiled=self.compiled,
            )
        return None

    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.compact.values())


def _optimizer(
    kind: str,
    params: Any,
    impl: str = "foreach",
    chunk: int = CHUNK,
    compiled: bool = False,
    **hp: Any,
) -> torch.optim.Optimizer:
    if kind == "fp32":
        return torch.optim.AdamW(
            params, foreach=impl == "foreach", fused=True if impl == "fused" else None, **hp
        )
    return CompactAdamW(params, kind, impl=impl, chunk=chunk, compiled=compiled, **hp)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    if isinstance(opt, CompactAdamW):
        return opt.state_bytes()
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )


@dataclass(frozen=True)
class _Task:
    """A model and its data for the quality runs: every task goes through ``_train``.

    The loss is the cross entropy of ``model(inputs)`` (logits in the last dim) against
    ``targets`` (the same shape without it).
    """

    model: Callable[[], nn.Module]
    """Builds the model (called after ``torch.manual_seed(seed)``)."""
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    """One training batch ``(inputs, targets)`` drawn with the run's generator."""
    held_out: tuple[torch.Tensor, torch.Tensor]
    """The held-out ``(inputs, targets)``, evaluated in one batch after training."""
    steps: int
    """Optimizer steps per run."""
    lr: float
    """AdamW's learning rate (weight decay 0.01)."""


def _gpt_task(demo: Any) -> _Task:
    """The demo's GPT on the demo's text, the last 10 % held out (windows of 64 characters)."""
    text = demo.read_text()
    cut = int(len(text) * 0.9)
    train_data = demo.CharWindows(text[:cut], context=64, stride=32)
    chars = sorted(set(text))  # one alphabet for both parts
    lookup = {c: i for i, c in enumerate(chars)}
    train_data.ids = torch.tensor([lookup[c] for c in text[:cut]])
    held = torch.tensor([lookup[c] for c in text[cut:]])
    held_windows = held.unfold(0, 65, 16)
    cfg = demo.GPTConfig(vocab=len(chars), context=64)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(train_data), (32,), generator=g)
        windows = torch.stack([train_data[int(i)] for i in idx])
        return windows[:, :-1], windows[:, 1:]

    return _Task(
        model=lambda: demo.GPT(cfg),
        batch=batch,
        held_out=(held_windows[:, :-1], held_windows[:, 1:]),
        steps=_STEPS,
        lr=3e-3,
    )


def _gratings(n: int, g: torch.Generator, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy sinusoidal gratings ``(n, 1, size, size)`` and their classes (16): class
    ``c`` has orientation ``(c % 8) * 22.5`` degrees and 1.5 (``c < 8``) or 3 periods per image
    width; random phase, contrast in [0.5, 1), plus Gaussian noise of std 2."""
    label = torch.randint(16, (n,), generator=g)
    theta = (label % 8).float() * (math.pi / 8)
    freq = torch.where(label < 8, 1.5, 3.0) * (2 * math.pi / size)
    phase = torch.rand(n, generator=g) * (2 * math.pi)
    contrast = 0.5 + 0.5 * torch.rand(n, generator=g)
    coords = torch.arange(size, dtype=torch.float32)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    arg = (
        freq[:, None, None] * (xx * theta.cos()[:, None, None] + yy * theta.sin()[:, None, None])
        + phase[:, None, None]
    )
    images = contrast[:, None, None] * arg.sin() + 2.0 * torch.randn(n, size, size, generator=g)
    return images[:, None], label


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2),  # 400 elements: fp32 moments
        nn.GELU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),  # 4608
        nn.GELU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),  # 18432
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 64),  # 65536
        nn.GELU(),
        nn.Linear(64, 16),  # 1024: fp32 moments
    )


def _cnn_task() -> _Task:
    """The CNN on gratings: one fixed data set (generator seed 2026), 16384 train, 4096 held out."""
    g = torch.Generator().manual_seed(2026)
    train_x, train_y = _gratings(16384, g)
    held_out = _gratings(4096, g)

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(train_y), (128,), generator=gen)
        return train_x[idx], train_y[idx]

    return _Task(model=_cnn, batch=batch, held_out=held_out, steps=_CNN_STEPS, lr=1e-3)


def _train(task: _Task, kind: str, seed: int) -> dict[str, Any]:
    """One run: ``seed`` sets the model's init and the batch order."""
    torch.manual_seed(seed)
    model = task.model()
    opt = _optimizer(kind, model.parameters(), lr=task.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1000 + seed)
    losses: list[float] = []
    tic = time.perf_counter()
    for _ in range(task.steps):
        inputs, targets = task.batch(g)
        loss = F.cross_entropy(model(inputs).flatten(0, -2), targets.flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    elapsed = time.perf_counter() - tic
    with torch.no_grad():
        inputs, targets = task.held_out
        logits = model(inputs)
        held_loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        held_accuracy = (logits.argmax(-1) == targets).float().mean()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    compact = sum(p.numel() for p in params if stores_compact(p.numel(), p.dtype))
    return {
        "final_train_loss": statistics.fmean(losses[-20:]),
        "held_out_loss": float(held_loss),
        "held_out_accuracy": float(held_accuracy),
        "state_bytes_per_param": _state_bytes(opt) / n_params,
        "params": n_params,
        "compact_param_share": compact / n_params,
        "seconds": elapsed,
        "loss_curve": [
            statistics.fmean(losses[i : i + _CURVE_EVERY])
            for i in range(0, len(losses), _CURVE_EVERY)
        ],
    }


def _quality_runs(task: _Task) -> dict[str, list[dict[str, Any]]]:
    """Every seed x kind, seeds outermost (so a slow phase of the machine hits all kinds)."""
    quality: dict[str, list[dict[str, Any]]] = {k: [] for k in _KINDS}
    for seed in _SEEDS:
        for kind in _KINDS:
            quality[kind].append(_train(task, kind, seed))
    return quality


def _quality_info(
    quality: dict[str, list[dict[str, Any]]], model: str, steps: int
) -> dict[str, Any]:
    """The figures recorded for one model's runs of ``steps`` steps (``model`` names the
    per-model keys)."""
    info: dict[str, Any] = {}
    for kind in _KINDS:
        finals = [r["final_train_loss"] for r in quality[kind]]
        helds = [r["held_out_loss"] for r in quality[kind]]
        info[f"{kind}_final_train_loss_mean"] = statistics.fmean(finals)
        info[f"{kind}_final_train_loss_min"] = min(finals)
        info[f"{kind}_final_train_loss_max"] = max(finals)
        info[f"{kind}_final_train_loss_seeds"] = finals
        info[f"{kind}_held_out_loss_mean"] = statistics.fmean(helds)
        info[f"{kind}_held_out_accuracy_mean"] = statistics.fmean(
            r["held_out_accuracy"] for r in quality[kind]
        )
        info[f"{kind}_{model}_state_bytes_per_param"] = quality[kind][0]["state_bytes_per_param"]
    for kind in ("int8", "int4"):
        ratios = [
            c["seconds"] / f["seconds"] for c, f in zip(quality[kind], quality["fp32"], strict=True)
        ]
        info[f"{kind}_{model}_train_step_ratio_vs_fp32_foreach"] = statistics.median(ratios)
    info["int8_mean_within_fp32_seed_spread"] = (
        info["fp32_final_train_loss_min"]
        <= info["int8_final_train_loss_mean"]
        <= info["fp32_final_train_loss_max"]
    )
    info["int8_mean_at_most_fp32_seed_max"] = (
        info["int8_final_train_loss_mean"] <= info["fp32_final_train_loss_max"]
    )
    n_points = len(quality["fp32"][0]["loss_curve"])
    curves: dict[str, list[float]] = {
        "step": [min((i + 1) * _CURVE_EVERY, steps) for i in range(n_points)]
    }
    for kind in _KINDS:
        curves[kind] = [
            statistics.fmean(points)
            for points in zip(*(r["loss_curve"] for r in quality[kind]), strict=True)
        ]
    info["loss_curves"] = curves  # mean training loss of each 10 steps, mean over the seeds
    return info


def _check_sane(quality: dict[str, list[dict[str, Any]]]) -> None:
    """Sanity only (a benchmark records, it does not judge): finite losses that went down."""
    for kind, runs in quality.items():
        for seed, r in zip(_SEEDS, runs, strict=True):
            assert math.isfinite(r["final_train_loss"]), (kind, seed, r["final_train_loss"])
            assert math.isfinite(r["held_out_loss"]), (kind, seed, r["held_out_loss"])
            assert r["final_train_loss"] < r["loss_curve"][0], (kind, seed, r["loss_curve"][:3])


_EAGER_CONFIGS = [
    ("fp32_fused", "fp32", "fused", CHUNK, False),
    ("fp32_foreach", "fp32", "foreach", CHUNK, False),
    ("int8_foreach", "int8", "foreach", CHUNK, False),
    ("int8_fused", "int8", "fused", CHUNK, False),
    ("int8_fused_chunk256k", "int8", "fused", 4 * CHUNK, False),
    ("int4_foreach", "int4", "foreach", CHUNK, False),
    ("int4_fused", "int4", "fused", CHUNK, False),
    ("int8_fused_compiled", "int8", "fused", CHUNK, True),
    ("int4_fused_compiled", "int4", "fused", CHUNK, True),
]
_COMPILED_CONFIGS = [
    ("fp32_fused", "fp32", "fused", CHUNK, False),
    ("fp32_foreach", "fp32", "foreach", CHUNK, False),
    ("int8_fused", "int8", "fused", CHUNK, False),
    ("int8_fused_compiled", "int8", "fused", CHUNK, True),
    ("int8_foreach_compiled", "int8", "foreach", CHUNK, True),
    ("int4_fused_compiled", "int4", "fused", CHUNK, True),
]


def _step_times(
    configs: list[tuple[str, str, str, int, bool]] = _EAGER_CONFIGS,
) -> dict[str, Any]:
    torch.manual_seed(0)
    runs: dict[str, tuple[list[nn.Parameter], torch.optim.Optimizer]] = {}
    for name, kind, impl, chunk, compiled in configs:
        params = [nn.Parameter(torch.randn(1024, 1024) * 0.02) for _ in range(4)]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = _optimizer(kind, params, impl=impl, chunk=chunk, compiled=compiled, lr=1e-4)
        runs[name] = (params, opt)
        runs[name][1].step()  # allocates the state (and compiles)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(_ROUNDS):
        order = list(runs)
        order = order[r % len(order) :] + order[: r % len(order)]
        for name in order:
            t0 = time.perf_counter()
            runs[name][1].step()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    phases: dict[str, dict[str, float]] = {}
    for name in ("int8_foreach", "int4_foreach", "int8_fused_compiled"):
        if name not in runs:
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runs[name][1].step()
        total = {
            e.key: e.cpu_time_total / 1e3
            for e in prof.key_averages()
            if e.key.startswith("shardkit.compact.")
        }
        phases[name] = total
    return {"median_s": med, "phases_ms": phases, "params": 4 * 1024 * 1024}


def _codec_times() -> dict[str, float]:
    """ns per element of one chunk's quantize / dequantize: eager, and the same pure functions
    (``_encode_rows``, ``_decode``) under ``torch.compile`` (inductor's C++ on a CPU), which must
    give the same bits."""
    out: dict[str, float] = {}
    n = 4 * CHUNK
    for kind in ("int8", "int4"):
        for fmt in moment_formats(kind):
            tables = lookup_tables(fmt.map_name, torch.device("cpu"))
            x = torch.randn(n)
            if not fmt.qmap.signed:
                x = x.square()
            want = CompactTensor.from_tensor(x, fmt)
            got = CompactTensor.zeros((n,), fmt)
            rows = x.view(-1, fmt.block)
            y = torch.empty(n)
            encode = torch.compile(_encode_rows, dynamic=False)
            decode = torch.compile(_decode, dynamic=False)
            enc_args = (rows, got.scales, got.codes, 0, fmt.qmap, tables)
            dec_args = (want.codes, want.scales, tables.pairs, fmt.block, y)
            cases: list[tuple[str, Any, tuple[Any, ...]]] = [
                ("eager_quantize", _encode_rows, enc_args),
                ("compiled_quantize", encode, enc_args),
                ("eager_dequantize", _decode, dec_args),
                ("compiled_dequantize", decode, dec_args),
            ]
            for name, fn, args in cases:
                fn(*args)  # compiles
                if name.endswith("_quantize"):
                    assert got.equal(want), (fmt.map_name, name)
                else:
                    assert torch.equal(y, want.dequantize()), (fmt.map_name, name)
                ts = []
                for _ in range(_ROUNDS):
                    t0 = time.perf_counter()
                    fn(*args)
                    ts.append(time.perf_counter() - t0)
                out[f"{fmt.map_name}_{name}_ns_per_element"] = statistics.median(ts) / n * 1e9
    return out


def test_bench_compact_state(benchmark: Any) -> None:
    torch.set_num_threads(1)
    task = _gpt_task(_demo())
    quality: dict[str, list[dict[str, Any]]] = {}
    timing: dict[str, Any] = {}

    def run_all() -> None:
        quality.update(_quality_runs(task))
        timing.update(_step_times())
        timing["codec"] = _codec_times()

    load_before = os.getloadavg()[0]
    benchmark.pedantic(run_all, rounds=1, iterations=1)
    info = _quality_info(quality, "gpt", task.steps)
    # large matrices only: every param compact
    big = [torch.zeros(1024, 1024)]
    for kind, k in (("fp32", None), ("int8", "int8"), ("int4", "int4")):
        info[f"{kind}_matrix_state_bytes_per_param"] = (
            AdamState.zeros(big[0], k).nbytes / big[0].numel()
        )
    med = timing["median_s"]
    for name in med:
        if name.startswith("int"):
            info[f"{name}_step_ratio_vs_fp32_fused"] = med[name] / med["fp32_fused"]
            info[f"{name}_step_ratio_vs_fp32_foreach"] = med[name] / med["fp32_foreach"]
    info["results"] = {"quality": quality, "timing": timing, "steps": task.steps}
    info["loadavg_1min"] = [load_before, os.getloadavg()[0]]
    benchmark.extra_info.update(info)
    print(json.dumps(info, indent=1, default=str))
    _check_sane(quality)


_COMPILE_COST_SCRIPT = """
import json, sys, time, torch
from shardkit.optim._compact_step import AdamState, compact_adam_step
torch.set_num_threads(1)
kind, impl = sys.argv[1], sys.argv[2]
ps = [torch.randn(1024, 1024) for _ in range(4)]
gs = [torch.randn_like(p) * 1e-3 for p in ps]
st = [AdamState.zeros(p, kind, fused=impl == "fused") for p in ps]
times = []
for _ in range(4):
    t0 = time.perf_counter()
    compact_adam_step(ps, gs, st, lr=1e-4, impl=impl, compiled=True)
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""


def _compile_cost(kind: str, impl: str) -> dict[str, float]:
    """First-step cost of the compiled step in a fresh process: cold (an empty inductor cache)
    and warm (the cache the cold run left), minus a later step's time."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        for label in ("cold", "warm"):
            run = subprocess.run(
                [sys.executable, "-c", _COMPILE_COST_SCRIPT, kind, impl],
                capture_output=True, text=True, check=True, env=env, timeout=900,
            )  # fmt: skip
            times = json.loads(run.stdout.strip().splitlines()[-1])
            out[f"{label}_first_step_s"] = times[0]
            out[f"{label}_compile_s"] = times[0] - statistics.median(times[1:])
    return out


def test_bench_compact_compiled_step(benchmark: Any) -> None:
    """The compiled compact step (issue 51) alone: interleaved against fp32 AdamW and the eager
    compact step, and its first-step compilation cost (``-k compiled``, about 2 minutes)."""
    torch.set_num_threads(1)
    timing: dict[str, Any] = {}

    def run_all() -> None:
        timing.update(_step_times(_COMPILED_CONFIGS))
        timing["compile_int8_fused"] = _compile_cost("int8", "fused")

    load_before = os.getloadavg()[0]
    benchmark.pedantic(run_all, rounds=1, iterations=1)
    med = timing["median_s"]
    info: dict[str, Any] = {f"{name}_ms": round(med[name] * 1e3, 2) for name in med}
    for name in med:
        if name.startswith("int"):
            info[f"{name}_vs_fp32_fused"] = round(med[name] / med["fp32_fused"], 2)
    info["compiled_speedup_vs_eager_int8_fused"] = round(
        med["int8_fused"] / med["int8_fused_compiled"], 2
    )
    info["compile_int8_fused"] = {k: round(v, 2) for k, v in timing["compile_int8_fused"].items()}
    info["phases_ms"] = timing["phases_ms"]
    info["loadavg_1min"] = [load_before, os.getloadavg()[0]]
    benchmark.extra_info.update(info)
    print(json.dumps(info, indent=1, default=str))


def test_bench_compact_quality_cnn(benchmark: Any) -> None:
    """Quality on the second model: the CNN on noisy gratings (module docstring, part 2)."""
    torch.set_num_threads(1)
    task = _cnn_task()
    quality: dict[str, list[dict[str, Any]]] = {}
    load_before = os.getloadavg()[0]
    benchmark.pedantic(lambda: quality.update(_quality_runs(task)), rounds=1, iterations=1)
    info = _quality_info(quality, "cnn", task.steps)
    info["cnn_params"] = quality["fp32"][0]["params"]
    info["cnn_compact_param_share"] = quality["fp32"][0]["compact_param_share"]
    info["results"] = {"quality": quality, "steps": task.steps, "lr": task.lr}
    info["loadavg_1min"] = [load_before, os.getloadavg()[0]]
    benchmark.extra_info.update(info)
    print(json.dumps({k: v for k, v in info.items() if k != "results"}, indent=1))
    _check_sane(quality)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q", "-s", "-o", "python_files=bench_*.py"])


@pytest.mark.cuda
def test_bench_compact_kernel_cuda(benchmark: Any) -> None:
    """The compact step alone on a GPU against torch's fused AdamW (issue 51's GPU target: at
    most fused AdamW's time)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    runs: dict[str, Callable[[], None]] = {}
    first: dict[str, float] = {}
    for name in ("fp32_fused", "int8_kernel", "int4_kernel", "int8_eager"):
        params = [torch.randn(2048, 2048, device="cuda") * 0.02 for _ in range(8)]
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        if name == "fp32_fused":
            ps = [nn.Parameter(p) for p in params]
            for p, g in zip(ps, grads, strict=True):
                p.grad = g
            opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)
            runs[name] = opt.step
        else:
            kind, how = name.split("_")
            states = [AdamState.zeros(p, kind, fused=True) for p in params]

            def step(
                params: list[torch.Tensor] = params, grads: list[torch.Tensor] = grads,
                states: list[AdamState] = states, compiled: bool = how == "kernel",
            ) -> None:  # fmt: skip
                compact_adam_step(
                    params, grads, states, lr=1e-4, weight_decay=0.01,
                    decoupled_weight_decay=True, impl="fused", compiled=compiled,
                )  # fmt: skip

            runs[name] = step
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runs[name]()
        torch.cuda.synchronize()
        first[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in runs}

    def measure() -> None:
        for r in range(_ROUNDS):
            order = list(runs)
            order = order[r % len(order) :] + order[: r % len(order)]
            for name in order:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                runs[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    info: dict[str, Any] = {f"{name}_ms": round(med[name], 3) for name in med}
    for name in med:
        if name != "fp32_fused":
            info[f"{name}_vs_fp32_fused"] = round(med[name] / med["fp32_fused"], 2)
    info["first_call_s"] = {name: round(t, 2) for name, t in first.items()}
    info["device"] = torch.cuda.get_device_name()
    benchmark.extra_info.update(info)
    print(json.dumps(info, indent=1))
