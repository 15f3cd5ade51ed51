"""Benchmarks: OffloadModel overhead on CPU (and throughput/peak memory on CUDA when present).

Run: python3 -m pytest -o python_files='bench_*.py' packages/offload/benchmarks -q
Ratios are against the plain model (and fairscale's OffloadModel on CUDA) in the same run.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable

import pytest
import torch
from shardkit.offload import OffloadModel
from torch import nn

D, LAYERS, BATCH = 512, 8, 256


def _model(d: int = D, n: int = LAYERS) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(d, d), nn.GELU()]
    return nn.Sequential(*layers)


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor
) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    return step


@pytest.mark.parametrize(
    "variant", ["plain", "offload", "offload-ckpt", "offload-ckpt-mb4", "offload-staged"]
)
def test_cpu_train_step(benchmark: pytest.FixtureRequest, variant: str) -> None:
    torch.manual_seed(0)
    base = _model()
    x = torch.randn(BATCH, D)
    model: nn.Module
    if variant == "plain":
        model = base
    else:
        model = OffloadModel(
            copy.deepcopy(base),
            "cpu",
            num_slices=4,
            checkpoint_activation="ckpt" in variant,
            num_microbatches=4 if "mb4" in variant else 1,
            stage_on_same_device=variant == "offload-staged",
        )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    benchmark.group = "cpu-train-step"
    benchmark.pedantic(_train_step(model, opt, x), rounds=15, warmup_rounds=2)  # type: ignore[attr-defined]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("threads", ["all", "1"])
@pytest.mark.parametrize("variant", ["device", "shardkit", "fairscale"])
def test_cuda_train_step(benchmark: pytest.FixtureRequest, variant: str, threads: str) -> None:
    """24 x Linear(4096) + GELU (1.5 GiB of fp32 params), 6 slices, batch 64, SGD on the host.

    The optimizer runs on the CPU for both offload implementations, so the host's intra-op
    threads matter: ``all`` is what a user gets by default, ``1`` is what ``hatch run bench``
    (OMP_NUM_THREADS=1) would otherwise impose. ``extra_info`` holds the phase split of three
    extra steps (forward, backward, optimizer; synchronised between phases) and the peak.
    """
    saved_threads = torch.get_num_threads()
    torch.set_num_threads((os.cpu_count() or 1) if threads == "all" else 1)
    torch.manual_seed(0)
    d, n, slices, batch = 4096, 24, 6, 64
    x = torch.randn(batch, d, device="cuda")
    base = _model(d, n)
    model: nn.Module
    if variant == "device":
        model = base.cuda()
    elif variant == "shardkit":
        model = OffloadModel(base, "cuda", num_slices=slices, checkpoint_activation=True)
    else:
        fs = pytest.importorskip("fairscale.experimental.nn.offload")
        model = fs.OffloadModel(
            base,
            device=torch.device("cuda"),
            offload_device=torch.device("cpu"),
            num_slices=slices,
            checkpoint_activation=True,
            num_microbatches=1,
        )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = _train_step(model, opt, x)
    try:
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

        def timed() -> None:
            step()
            torch.cuda.synchronize()

        benchmark.group = f"cuda-train-step-threads-{threads}"
        benchmark.pedantic(timed, rounds=20, warmup_rounds=1)  # type: ignore[attr-defined]
        phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            loss.backward()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                phases[k].append(v)
        info = benchmark.extra_info  # type: ignore[attr-defined]
        info["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        info["params_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        info["two_slices_mib"] = 2 * info["params_mib"] / slices
        info["threads"] = torch.get_num_threads()
        for k, v in phases.items():
            info[f"{k}_ms"] = 1e3 * sorted(v)[1]
    finally:
        torch.set_num_threads(saved_threads)
