"""Step time: plain DDP + Adam, ShardedOptimizer without hooks, and the overlap hooks.

The hooks run with the all-reduce (``hook_with_zero_step``, ``hook_interleaved``) and with
``reduce_to_owner=True`` (``hook_reduce_to_owner``, ``interleaved_reduce_to_owner``).

Gloo, world 2, 8 x (Linear(2048, 2048) + GELU), batch 32, Adam (the shardkit-optim benchmark's
model). One pair of spawned processes builds the six variants and runs them in turn, one step
each per round, so load changes on a shared machine hit all variants alike; the figure is the
median step (zero_grad + forward + backward + step) after one warm-up round. Run with
``python3 -m pytest -o python_files='bench_*.py' packages/overlap/benchmarks -q -s``.
Set ``SHARDKIT_BENCH_STEPS`` (default 8) and ``SHARDKIT_BENCH_WIDTH`` (default 2048). With two
or more CUDA GPUs the same variants also run on NCCL.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

_VARIANTS = [
    "ddp_adam",
    "sharded_no_hook",
    "hook_with_zero_step",
    "hook_interleaved",
    "hook_reduce_to_owner",
    "interleaved_reduce_to_owner",
]
_HOOKS = _VARIANTS[2:]


def _build(variant: str, width: int, device: torch.device) -> tuple[DDP, Any, Any]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers).to(device)
    ddp = DDP(model)
    overlap: Any = None
    if variant == "ddp_adam":
        opt: Any = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        from shardkit.optim import ShardedOptimizer

        opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-4)
        if variant != "sharded_no_hook":
            from shardkit.overlap import register_zero_overlap

            overlap = register_zero_overlap(
                ddp,
                opt,
                interleaved=variant.startswith(("hook_interleaved", "interleaved")),
                shard_buckets=True,
                reduce_to_owner=variant.endswith("reduce_to_owner"),
            )
    return ddp, opt, overlap


def _worker(
    rank: int, backend: str, port: int, out: str, steps: int, width: int
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=2)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    runs = {v: _build(v, width, device) for v in _VARIANTS}
    x = torch.randn(32, width, device=device)
    times: dict[str, list[float]] = {v: [] for v in _VARIANTS}
    # The variants take turns step by step in the same processes, so that a change of load on
    # a shared machine hits all of them alike (ratios are then comparable within one run).
    for s in range(steps + 1):
        for v in _VARIANTS:
            ddp, opt, _ = runs[v]
            dist.barrier()
            if backend == "nccl":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()  # with the hooks: a no-op consuming their update
            if backend == "nccl":
                torch.cuda.synchronize()
            if s > 0:  # step 0: warm-up, DDP rebuilds its buckets
                times[v].append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({v: statistics.median(t) for v, t in times.items()}, f)
    for _, _, overlap in runs.values():
        if overlap is not None:
            overlap.close()
    dist.barrier()
    dist.destroy_process_group()


def _run(backend: str, steps: int, width: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(_worker, args=(backend, port, out, steps, width), nprocs=2, join=True)
        with open(out) as f:
            return {k: float(v) for k, v in json.load(f).items()}


def _bench(benchmark: Any, backend: str) -> None:
    steps = int(os.environ.get("SHARDKIT_BENCH_STEPS", "8"))
    width = int(os.environ.get("SHARDKIT_BENCH_WIDTH", "2048"))
    results: dict[str, float] = {}

    def run_all() -> None:
        results.update(_run(backend, steps, width))

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    base = results["ddp_adam"]
    ratios = {v: results[v] / base for v in _VARIANTS}
    ratios["best_hook"] = min(ratios[v] for v in _HOOKS)
    # Flat numeric keys: tools/bench.py renders those containing "ratio" / "_over_".
    benchmark.extra_info.update(
        {
            "backend": backend,
            "load_average_1m": os.getloadavg()[0],
            **{f"{v}_step_ms": results[v] * 1e3 for v in _VARIANTS},
            "no_hook_ratio_vs_ddp": ratios["sharded_no_hook"],
            "hook_ratio_vs_ddp": ratios["hook_with_zero_step"],
            "interleaved_ratio_vs_ddp": ratios["hook_interleaved"],
            "reduce_to_owner_ratio_vs_ddp": ratios["hook_reduce_to_owner"],
            "interleaved_reduce_to_owner_ratio_vs_ddp": ratios["interleaved_reduce_to_owner"],
            "best_hook_ratio_vs_ddp": ratios["best_hook"],
            "best_hook_over_no_hook": ratios["best_hook"] / ratios["sharded_no_hook"],
        }
    )
    print(f"\n{backend}: {'variant':<30}{'step ms':>10}{'x DDP+Adam':>12}")
    for v in _VARIANTS:
        print(f"{'':<{len(backend) + 2}}{v:<30}{results[v] * 1e3:>10.1f}{ratios[v]:>12.3f}")
    print(f"best hook / DDP+Adam: {ratios['best_hook']:.3f}  (load average {os.getloadavg()})")


def test_bench_gloo(benchmark: Any) -> None:
    _bench(benchmark, "gloo")


def test_bench_nccl(benchmark: Any) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs for NCCL world 2")
    _bench(benchmark, "nccl")
