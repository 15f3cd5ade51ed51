"""Side-by-side benchmark: DDP + Adam, torch ZeroRedundancyOptimizer, fairscale OSS, shardkit.

Gloo, world 2, 8 x Linear(2048, 2048) + GELU, batch 32, Adam. Each implementation runs in its own
pair of spawned processes (so peak-RSS figures do not mix). Run with
``python3 -m pytest -o python_files='bench_*.py' packages/optim/benchmarks -q -s``.
Set ``SHARDKIT_BENCH_STEPS`` (default 6) and ``SHARDKIT_BENCH_WIDTH`` (default 2048).
"""

from __future__ import annotations

import json
import os
import resource
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

_IMPLS = ["ddp_adam", "torch_zero", "fairscale_oss", "shardkit"]


def _state_bytes(opt: Any) -> int:
    inner = getattr(opt, "optim", opt)
    return sum(
        v.numel() * v.element_size()
        for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )


def _worker(rank: int, impl: str, port: int, out: str, steps: int, width: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers)
    ddp = DDP(model)
    if impl == "ddp_adam":
        opt: Any = torch.optim.Adam(model.parameters(), lr=1e-4)
    elif impl == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    elif impl == "fairscale_oss":
        from fairscale.optim import OSS as FairscaleOSS

        opt = FairscaleOSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
    else:
        from shardkit.optim import ShardedOptimizer

        opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
    x = torch.randn(32, width)
    times = []
    for s in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if s > 0:  # first step allocates the state
            times.append(time.perf_counter() - t0)
    local_bytes = _state_bytes(opt)
    cons_s = float("nan")
    peak_mb = float("nan")
    if impl != "ddp_adam":
        dist.barrier()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        opt.consolidate_state_dict(0) if impl != "shardkit" else opt.consolidate_state_dict(recipient_rank=0)
        if rank == 0:
            sd = opt.state_dict()
            assert len(sd["state"]) == 16
        cons_s = time.perf_counter() - t0
        peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {"step_s": statistics.median(times), "state_bytes": local_bytes,
                 "consolidate_s": cons_s, "recipient_rss_growth_mb": peak_mb}, f,
            )
    dist.barrier()
    dist.destroy_process_group()


def _run(impl: str, steps: int, width: int) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(_worker, args=(impl, port, out, steps, width), nprocs=2, join=True)
        with open(out) as f:
            res: dict[str, float] = json.load(f)
            return res


def test_bench_step_state_consolidation(benchmark: Any) -> None:
    pytest.importorskip("fairscale")
    steps = int(os.environ.get("SHARDKIT_BENCH_STEPS", "6"))
    width = int(os.environ.get("SHARDKIT_BENCH_WIDTH", "2048"))
    results: dict[str, dict[str, float]] = {}

    def run_all() -> None:
        for impl in _IMPLS:
            results[impl] = _run(impl, steps, width)

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    ddp, zero, fs, sk = (results[i] for i in _IMPLS)
    ratios = {
        "step_vs_ddp": sk["step_s"] / ddp["step_s"],
        "step_vs_torch_zero": sk["step_s"] / zero["step_s"],
        "state_vs_ddp": sk["state_bytes"] / ddp["state_bytes"],
        "consolidation_speedup_vs_fairscale": fs["consolidate_s"] / sk["consolidate_s"],
        "consolidation_speedup_vs_torch_zero": zero["consolidate_s"] / sk["consolidate_s"],
    }
    benchmark.extra_info.update({"results": results, "ratios": ratios})
    print()
    print(f"{'impl':<15}{'step ms':>10}{'state MB/rank':>15}{'consolidate s':>15}{'rank0 RSS +MB':>15}")
    for impl in _IMPLS:
        r = results[impl]
        print(
            f"{impl:<15}{r['step_s'] * 1e3:>10.1f}{r['state_bytes'] / 2**20:>15.1f}"
            f"{r['consolidate_s']:>15.3f}{r['recipient_rss_growth_mb']:>15.1f}"
        )
    print(json.dumps(ratios, indent=1))
