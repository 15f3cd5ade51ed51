"""ShardedDataParallel vs DDP: bytes on the wire, bytes held per param, step time.

Gloo on CPU, spawned ranks; model: 6 x Linear(W, W) + GELU (``SHARDKIT_BENCH_WIDTH``, default
512), batch 16, AdamW.

- ``bytes``: ring-model bytes per rank per step (see [Note: Byte accounting] in
  ``shardkit.optim._wire``) counted by shardkit-ddp's communication layer over one step, against
  the same model for DDP (all-reduce of every grad: ``2(N-1)/N``) and for torch
  ZeroRedundancyOptimizer / fairscale OSS (DDP's all-reduce plus every param broadcast from
  its owner: ``+ (N-1)/N``), world 2 and 4; and with ``reduce_fp16=True`` against DDP with
  ``fp16_compress_hook`` (an fp16 all-reduce). The bytes Gloo actually sends are measured by
  ``wire_bytes.py`` (Gloo's reduce-scatter sends twice the ring figure, so on Gloo the package
  sends 1.5x DDP's bytes).
- ``memory``: bytes per param held on rank 0 after a step (live tensors: params, grads, grad
  shards, staging buffers, optimizer state, masters), bf16 model + fp32 masters + AdamW, against
  DDP + AMP (fp32 params, fp32 grads as bucket views, AdamW state), world 2 and 4.
- ``step``: step time (forward, backward, step) vs DDP with the same local AdamW, foreach and
  fused, world 2, interleaved round robin so machine load hits both alike (the default, and
  ``keep_staging_buffers=False``: the staging pool freed after each step); and the overlap
  efficiency ``1 - (t_step - t_local) / t_comm`` with ``t_local`` the same step with no
  communication (one rank's compute alone) and ``t_comm`` the package's collectives of one step
  run alone.

Run: ``python -m pytest -o python_files='bench_*.py' packages/ddp/benchmarks -q -s``.
"""

from __future__ import annotations

import copy
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

_WIDTH = int(os.environ.get("SHARDKIT_BENCH_WIDTH", "512"))
_STEPS = int(os.environ.get("SHARDKIT_BENCH_STEPS", "6"))


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(_WIDTH, _WIDTH), nn.GELU()]
    return nn.Sequential(*layers).to(dtype)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nbytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {"bytes": _bytes, "memory": _memory, "step": _step}[mode](rank, world)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _batch(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(16, _WIDTH, generator=torch.Generator().manual_seed(rank)).to(dtype)


def _bytes(rank: int, world: int) -> dict[str, Any]:
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer

    counted = []
    for reduce_fp16 in (False, True):
        m = _model()
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        sdp = ShardedDataParallel(m, opt, broadcast_buffers=False, reduce_fp16=reduce_fp16)
        sdp(_batch(rank)).square().mean().backward()
        opt.step()
        counted.append(sdp.comm_stats)
    stats, fp16_stats = counted
    model_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    ring = (world - 1) / world
    ddp = 2 * ring * model_bytes
    ddp_fp16_hook = ddp / 2  # all-reduce of the fp16-compressed gradients
    return {
        "shardkit_fp16_reduce_bytes": fp16_stats.total_bytes(),
        "shardkit_fp16_reduce_vs_ddp": fp16_stats.total_bytes() / ddp,
        "shardkit_fp16_reduce_vs_ddp_fp16_hook": fp16_stats.total_bytes() / ddp_fp16_hook,
        "world": world,
        "model_bytes": model_bytes,
        "shardkit_bytes": stats.total_bytes(),
        "ddp_bytes": ddp,
        "zero1_bytes": ddp + ring * model_bytes,
        "shardkit_vs_ddp": stats.total_bytes() / ddp,
        "zero1_vs_ddp": (ddp + ring * model_bytes) / ddp,
        "collectives": dict(stats.calls),
    }


def _shardkit_memory(rank: int, cap_mb: float) -> tuple[int, dict[str, int]]:
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer

    m = _model(torch.bfloat16)
    n = sum(p.numel() for p in m.parameters())
    opt = ShardedOptimizer(
        m.parameters(), optim=torch.optim.AdamW, lr=1e-3, master_dtype=torch.float32
    )
    sdp = ShardedDataParallel(m, opt, broadcast_buffers=False, bucket_cap_mb=cap_mb)
    sdp(_batch(rank, torch.bfloat16)).float().square().mean().backward()
    opt.step()
    return n, sdp.memory_bytes()


def _memory(rank: int, world: int) -> dict[str, Any]:
    # 25 MiB buckets (DDP's default) are larger than this 3 MB bf16 model: the two staging
    # buffers then dominate; 0.25 MiB buckets show the per-param figures of a large model.
    _, small = _shardkit_memory(rank, 0.25)
    n, mem = _shardkit_memory(rank, 25.0)
    ref = _model()
    ddp = DDP(ref, gradient_as_bucket_view=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ddp(_batch(rank)).float().square().mean()
    loss.backward()
    ref_opt.step()
    live = [*ref.parameters()]
    live += [p.grad for p in ref.parameters() if p.grad is not None]
    live += [v for st in ref_opt.state.values() for v in st.values() if v.dim() > 0]
    ddp_bytes = _nbytes(live)
    staging_per_param = mem["staging"] / n
    return {
        "world": world,
        "params": n,
        "shardkit_bytes_per_param": sum(mem.values()) / n,
        "shardkit_breakdown_per_param": {k: v / n for k, v in mem.items()},
        "target_bytes_per_param": 2 + (2 + 12) / world + staging_per_param,
        "small_buckets_bytes_per_param": sum(small.values()) / n,
        "small_buckets_breakdown_per_param": {k: v / n for k, v in small.items()},
        "small_buckets_target_bytes_per_param": 2 + (2 + 12) / world + small["staging"] / n,
        "ddp_amp_bytes_per_param": ddp_bytes / n,
    }


def zero2_comm_alone(buckets: Any) -> float:
    """Seconds of ShardedDataParallel's collectives of one step run alone: a reduce-scatter and
    an all-gather of every bucket, issued by the package's own communication layer (so on Gloo
    the same in-place reduces and broadcasts), on copies of the buffers made beforehand."""
    from shardkit.optim._wire import Wire

    comm = Wire(dist.group.WORLD)
    copies = [(b.flat.clone(), b.flat.clone(), b.shard) for b in buckets]
    lo, hi = comm.rank, comm.rank + 1
    dist.barrier()
    t0 = time.perf_counter()
    for staging, _, s in copies:
        comm.wait(comm.reduce_scatter(staging, staging[lo * s : hi * s]))
    for _, gathered, s in copies:
        comm.wait(comm.all_gather(gathered, gathered[lo * s : hi * s]))
    return time.perf_counter() - t0


def _step(rank: int, world: int) -> dict[str, Any]:
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer

    x = _batch(rank)
    out: dict[str, Any] = {"world": world}
    for label, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        base = _model()
        ref = DDP(copy.deepcopy(base))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, **kw)
        m = copy.deepcopy(base)
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-3, **kw)
        sdp = ShardedDataParallel(m, opt, broadcast_buffers=False)
        m_free = copy.deepcopy(base)
        opt_free = ShardedOptimizer(m_free.parameters(), optim=torch.optim.AdamW, lr=1e-3, **kw)
        sdp_free = ShardedDataParallel(
            m_free, opt_free, broadcast_buffers=False, keep_staging_buffers=False
        )
        local = copy.deepcopy(base)
        local_opt = torch.optim.AdamW(local.parameters(), lr=1e-3, **kw)
        runs: dict[str, tuple[nn.Module, Any]] = {
            "ddp": (ref, ref_opt),
            "shardkit": (sdp, opt),
            "shardkit_free_staging": (sdp_free, opt_free),
            "local": (local, local_opt),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for it in range(_STEPS + 1):
            order = list(runs)[it % len(runs) :] + list(runs)[: it % len(runs)]
            for k in order:
                model, o = runs[k]
                dist.barrier()
                t0 = time.perf_counter()
                o.zero_grad()
                model(x).square().mean().backward()
                o.step()
                if it:
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        t_comm = statistics.median(zero2_comm_alone(sdp._buckets) for _ in range(_STEPS))
        out[label] = {
            "step_s": med,
            "shardkit_vs_ddp": med["shardkit"] / med["ddp"],
            "shardkit_free_staging_vs_ddp": med["shardkit_free_staging"] / med["ddp"],
            "comm_alone_s": t_comm,
            "overlap_efficiency": 1 - (med["shardkit"] - med["local"]) / t_comm,
        }
    return out


def _spawn(mode: str, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        mp.spawn(_worker, args=(world, _port(), mode, out), nprocs=world, join=True)
        with open(out) as f:
            return dict(json.load(f))


@pytest.mark.parametrize("world", [2, 4])
def test_bench_bytes_and_memory(benchmark: Any, world: int) -> None:
    results: dict[str, Any] = {}
    benchmark.pedantic(
        lambda: results.update(bytes=_spawn("bytes", world), memory=_spawn("memory", world)),
        rounds=1,
        iterations=1,
    )
    benchmark.extra_info["bytes_vs_ddp"] = results["bytes"]["shardkit_vs_ddp"]
    benchmark.extra_info["zero1_bytes_vs_ddp"] = results["bytes"]["zero1_vs_ddp"]
    benchmark.extra_info["fp16_reduce_bytes_vs_ddp"] = results["bytes"][
        "shardkit_fp16_reduce_vs_ddp"
    ]
    benchmark.extra_info["fp16_reduce_bytes_vs_ddp_fp16_hook"] = results["bytes"][
        "shardkit_fp16_reduce_vs_ddp_fp16_hook"
    ]
    benchmark.extra_info["bytes_per_param"] = results["memory"]["shardkit_bytes_per_param"]
    benchmark.extra_info["target_bytes_per_param"] = results["memory"]["target_bytes_per_param"]
    benchmark.extra_info["ddp_amp_bytes_per_param"] = results["memory"]["ddp_amp_bytes_per_param"]
    benchmark.extra_info["bytes_per_param_small_buckets"] = results["memory"][
        "small_buckets_bytes_per_param"
    ]
    benchmark.extra_info["results"] = results
    print(json.dumps(results, indent=1))


def test_bench_step_time_world2(benchmark: Any) -> None:
    results: dict[str, Any] = {}
    benchmark.pedantic(lambda: results.update(_spawn("step", 2)), rounds=1, iterations=1)
    for label in ("foreach", "fused"):
        benchmark.extra_info[f"step_ratio_vs_ddp_{label}"] = results[label]["shardkit_vs_ddp"]
        benchmark.extra_info[f"step_ratio_vs_ddp_free_staging_{label}"] = results[label][
            "shardkit_free_staging_vs_ddp"
        ]
        benchmark.extra_info[f"overlap_efficiency_{label}"] = results[label]["overlap_efficiency"]
    benchmark.extra_info["results"] = results
    print(json.dumps(results, indent=1))
