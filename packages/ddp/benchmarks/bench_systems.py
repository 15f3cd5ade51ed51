"""Every data-parallel system on one model, interleaved in one run (issue 27).

Model: ``L`` x ``nn.Linear(W, W)`` (default 8 x 2048 = 33.6M params at world 2; world 4 runs
W = 1024, 8.4M params, so that four ranks holding every system at once fit the 24 GiB box;
``SHARDKIT_BENCH_SYS_WIDTH`` / ``SHARDKIT_BENCH_SYS_WIDTH4`` / ``SHARDKIT_BENCH_SYS_LAYERS``),
batch 32, AdamW (``fused=True`` everywhere it is accepted), Gloo on CPU, spawned ranks, one
thread each. Systems:

- ``ddp``: torch DDP + AdamW (the reference, ratio 1.00). Every DDP here runs with
  ``gradient_as_bucket_view=True`` (its best configuration: the gradients are views of its
  reduction buckets, so no copy, and the buckets are the ``.grad`` tensors, which the live count
  sees; without it DDP's buckets are C++-only allocations no Python count can see);
- ``torch_zero``: DDP + torch ``ZeroRedundancyOptimizer(AdamW)``;
- ``fairscale``: fairscale ``OSS(AdamW)`` + fairscale ``ShardedDataParallel``;
- ``fsdp2``: torch ``fully_shard`` per layer and at the root (FSDP2) + AdamW on its DTensors;
- ``shardkit_zero1``: DDP + ``ShardedOptimizer(AdamW)``; ``shardkit_zero1_overlap``: the same,
  stepped bucket by bucket inside backward by shardkit-overlap's comm hook
  (``register_zero_overlap``);
- ``shardkit_zero2``: ``ShardedDataParallel`` (param gathers overlapped with the next forward,
  the staging pool kept between steps: the defaults), ``shardkit_zero2_sync_gather``
  (``overlap_param_gather=False``) and ``shardkit_zero2_free_staging``
  (``keep_staging_buffers=False``: the staging pool freed after each step and allocated again
  by the next backward, fresh pages on CPU) and ``shardkit_zero2_views``
  (``gradient_as_bucket_view=True``: backward accumulates into the staging buffers instead of
  a multiply-copy into them), ``shardkit_zero2_int8`` / ``_int4`` (``wire="int8"`` /
  ``"int4"``: quantized gradients and weight deltas);
- bf16: ``ddp_bf16_autocast`` (fp32 model under ``torch.autocast(bfloat16)``),
  ``fsdp2_bf16`` (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``) and
  ``shardkit_zero2_bf16`` (bf16 params, fp32 masters).

Each round runs one step (``zero_grad``, forward, backward, ``step``) of every system, in an
order rotated every round, with a barrier before each; the figure per system is the median over
rounds of ``t_system / t_ddp`` of the same round, with the quartiles. Memory: before the timing,
each system alone is built, stepped once, and every live tensor storage is counted once
(``shardkit.testing.live_storages``, plus each param's ``.grad``), minus what was alive before
(bytes per param, rank 0). Overlap efficiency (DDP and every fp32 shardkit mode): ``1 - (t_step -
t_compute) / t_comm`` with ``t_compute`` the same model's forward + backward + an AdamW step
over this rank's share of the params with no communication, and ``t_comm`` the system's
collectives of one step run alone: the fraction of communication time hidden behind compute
(1: all hidden, 0: none; on a 2-core box the ranks' compute and Gloo's threads share two cores,
so compute slows while communication runs and the figure can go below 0).

Run: ``python -m pytest -o python_files='bench_*.py' packages/ddp/benchmarks/bench_systems.py
-q -s`` (``SHARDKIT_BENCH_SYS_ONLY=a,b`` runs only those systems and ``ddp``). Times on this box are ratios within one run; absolute times count only from a GPU.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ddp import zero2_comm_alone

_LAYERS = int(os.environ.get("SHARDKIT_BENCH_SYS_LAYERS", "8"))
_WIDTH = {
    2: int(os.environ.get("SHARDKIT_BENCH_SYS_WIDTH", "2048")),
    4: int(os.environ.get("SHARDKIT_BENCH_SYS_WIDTH4", "1024")),
}
_ROUNDS = int(os.environ.get("SHARDKIT_BENCH_SYS_ROUNDS", "8"))
_BATCH = 32
_FP32 = (
    "ddp",
    "torch_zero",
    "fairscale",
    "fsdp2",
    "shardkit_zero1",
    "shardkit_zero1_overlap",
    "shardkit_zero2",
    "shardkit_zero2_sync_gather",
    "shardkit_zero2_free_staging",
    "shardkit_zero2_views",
    "shardkit_zero2_int8",
    "shardkit_zero2_int4",
)
_BF16 = ("ddp_bf16_autocast", "fsdp2_bf16", "shardkit_zero2_bf16")
_ONLY = os.environ.get("SHARDKIT_BENCH_SYS_ONLY", "")
_SYSTEMS = tuple(s for s in _FP32 + _BF16 if not _ONLY or s == "ddp" or s in _ONLY.split(","))
log = logging.getLogger("shardkit.bench")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(width: int, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(_LAYERS)]).to(dtype)


class _System:
    """One system: a step function over its own copy of the model."""

    def __init__(self, name: str, model: nn.Module, opt: Any, autocast: bool = False) -> None:
        self.name = name
        self.model = model
        self.opt = opt
        self.autocast = autocast
        self.params = list(model.parameters())

    def step(self, x: torch.Tensor) -> None:
        self.opt.zero_grad()
        if self.autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.model(x).float().square().mean()
        else:
            loss = self.model(x.to(self.params[0].dtype)).float().square().mean()
        loss.backward()
        self.opt.step()


def _adamw(params: Any, **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=True, **kw)


def _build(name: str, width: int) -> _System:
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer

    fused = {"lr": 1e-4, "fused": True}
    if name in ("ddp", "ddp_bf16_autocast"):
        m = _model(width)
        return _System(
            name,
            DDP(m, gradient_as_bucket_view=True),
            _adamw(m.parameters()),
            autocast=name != "ddp",
        )
    if name == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        m = _model(width)
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, **fused)
        return _System(name, DDP(m, gradient_as_bucket_view=True), opt)
    if name == "fairscale":
        from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
        from fairscale.optim import OSS

        m = _model(width)
        oss = OSS(m.parameters(), optim=torch.optim.AdamW, **fused)
        return _System(name, FairscaleSDP(m, oss), oss)
    if name in ("fsdp2", "fsdp2_bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        m = _model(width)
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if name == "fsdp2_bf16"
            else MixedPrecisionPolicy()
        )
        for layer in m:
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(m, mp_policy=mp_policy)
        return _System(name, m, _adamw(m.parameters()))
    if name == "shardkit_zero1":
        m = _model(width)
        return _System(
            name,
            DDP(m, gradient_as_bucket_view=True),
            ShardedOptimizer(m.parameters(), torch.optim.AdamW, **fused),
        )
    if name == "shardkit_zero1_overlap":
        from shardkit.overlap import register_zero_overlap

        m = _model(width)
        ddp = DDP(m, gradient_as_bucket_view=True)
        zero = ShardedOptimizer(m.parameters(), torch.optim.AdamW, **fused)
        register_zero_overlap(ddp, zero)
        return _System(name, ddp, zero)
    if name.startswith("shardkit_zero2"):
        bf16 = name.endswith("bf16")
        m = _model(width, torch.bfloat16 if bf16 else torch.float32)
        opt = ShardedOptimizer(
            m.parameters(),
            torch.optim.AdamW,
            master_dtype=torch.float32 if bf16 else None,
            **fused,
        )
        sdp = ShardedDataParallel(
            m,
            opt,
            broadcast_buffers=False,
            overlap_param_gather=not name.endswith("gather"),
            keep_staging_buffers=not name.endswith("free_staging"),
            gradient_as_bucket_view=name.endswith("views"),
            wire=name[-4:] if name.endswith(("int8", "int4")) else "exact",
        )
        return _System(name, sdp, opt)
    raise ValueError(name)


def _batch(rank: int, width: int) -> torch.Tensor:
    return torch.randn(_BATCH, width, generator=torch.Generator().manual_seed(rank))


def _live_bytes_per_param(name: str, width: int, rank: int) -> float:
    from shardkit.testing import live_storages

    gc.collect()
    before = set(live_storages())
    system = _build(name, width)
    system.step(_batch(rank, width))
    if hasattr(system.model, "wait_params"):
        system.model.wait_params()
    live = live_storages(extra=[p.grad for p in system.params])
    n = width * width * _LAYERS + width * _LAYERS
    nbytes = sum(v for k, v in live.items() if k not in before)
    del system
    gc.collect()
    return nbytes / n


def _comm_alone(system: _System, world: int, rank: int) -> float:
    """The system's collectives of one step, alone (DDP: all-reduce of its 25 MiB buckets;
    shardkit ZeRO-2: the package's reduce-scatter + all-gather of its buckets; shardkit ZeRO-1:
    DDP's all-reduce, then one broadcast of each rank's share of the params from that rank)."""
    if system.name.startswith("shardkit_zero2"):
        return zero2_comm_alone(system.model._buckets)
    flat = torch.cat([p.detach().reshape(-1) for p in system.params])
    t0 = time.perf_counter()
    for chunk in flat.split(25 * 2**20 // 4):
        dist.all_reduce(chunk)
    if system.name.startswith("shardkit_zero1"):
        for src, share in enumerate(flat.tensor_split(world)):
            dist.broadcast(share, src=src)
    return time.perf_counter() - t0


def _compute_alone(width: int, rank: int, share: float) -> Callable[[], float]:
    """Forward + backward of the plain model and an AdamW step over ``share`` of its params."""
    m = _model(width)
    n = sum(p.numel() for p in m.parameters())
    flat = torch.zeros(int(n * share), requires_grad=True)
    flat.grad = torch.ones_like(flat)  # allocated once: the step's gradient is not the point
    opt = _adamw([flat])
    x = _batch(rank, width)

    def run() -> float:
        t0 = time.perf_counter()
        m.zero_grad()
        m(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - t0

    return run


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[-1]


def _run(rank: int, world: int) -> dict[str, Any]:
    width = _WIDTH[world]
    memory = {name: _live_bytes_per_param(name, width, rank) for name in _SYSTEMS}
    systems = [_build(name, width) for name in _SYSTEMS]
    x = _batch(rank, width)
    times: dict[str, list[float]] = {s.name: [] for s in systems}
    for r in range(_ROUNDS + 1):  # round 0 warms up (DDP rebuilds its buckets after it)
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for s in order:
            dist.barrier()
            t0 = time.perf_counter()
            s.step(x)
            if r:
                times[s.name].append(time.perf_counter() - t0)
    ratios = {
        name: [t / d for t, d in zip(v, times["ddp"], strict=True)] for name, v in times.items()
    }
    by_name = {s.name: s for s in systems}
    overlap: dict[str, float] = {}
    for name in by_name:
        if (name != "ddp" and not name.startswith("shardkit_")) or name.endswith("bf16"):
            continue
        share = 1.0 if name == "ddp" else 1 / world
        compute = _compute_alone(width, rank, share)
        t_compute = statistics.median([compute() for _ in range(4)])
        comm = []
        for _ in range(4):
            dist.barrier()
            comm.append(_comm_alone(by_name[name], world, rank))
        t_comm = statistics.median(comm)
        t_step = statistics.median(times[name])
        overlap[name] = 1 - (t_step - t_compute) / t_comm
    return {
        "world": world,
        "width": width,
        "params": width * width * _LAYERS + width * _LAYERS,
        "rounds": _ROUNDS,
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "ratio_vs_ddp": {k: _quartiles(v) for k, v in ratios.items()},
        "bytes_per_param": memory,
        "overlap_efficiency": overlap,
    }


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _run(rank, world)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _spawn(world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        mp.spawn(_worker, args=(world, _port(), out), nprocs=world, join=True)
        with open(out) as f:
            return dict(json.load(f))


@pytest.mark.parametrize("world", [2, 4])
def test_bench_systems(benchmark: Any, world: int) -> None:
    results: dict[str, Any] = {}
    benchmark.pedantic(lambda: results.update(_spawn(world)), rounds=1, iterations=1)
    info = benchmark.extra_info
    for name, (q1, med, q3) in results["ratio_vs_ddp"].items():
        if name == "ddp":
            continue
        info[f"{name}_vs_ddp"] = med
        info[f"{name}_vs_ddp_q1"] = q1
        info[f"{name}_vs_ddp_q3"] = q3
    info["results"] = {
        name: {
            "step_vs_ddp": results["ratio_vs_ddp"][name][1],
            "step_vs_ddp_q1": results["ratio_vs_ddp"][name][0],
            "step_vs_ddp_q3": results["ratio_vs_ddp"][name][2],
            "bytes_per_param": results["bytes_per_param"][name],
            "overlap_efficiency": results["overlap_efficiency"].get(name, float("nan")),
            "step_s": results["step_s"][name],
        }
        for name in _SYSTEMS
    }
    info["model"] = (
        f"{_LAYERS} x Linear({results['width']}), {results['params']:,} params, batch {_BATCH}, "
        f"AdamW fused, Gloo CPU, world {world}, {results['rounds']} rounds"
    )
    print(json.dumps(results, indent=1))
