"""Live bytes per param of ZeRO-2 (ShardedDataParallel) with ``compact_state`` (issue 40).

Gloo, ``ShardedDataParallel`` + ``ShardedOptimizer(AdamW)``, the 33.6M-param benchmark model
(8 x ``Linear(2048, 2048)``), world 2 and 4, three steps; rank 0's live tensor storages (each
counted once, grads included: ``shardkit.testing.live_storages``) and its sharded optimizer
state (masters + moments, ``ShardStepper.state_bytes``), for fp32 params, bf16 params with
fp32 masters and bf16 params with remainder masters (``master_remainder=True``), with fp32, int8
and int4 moments, and int8 with ``keep_staging_buffers=False``
(``_lean``: the staging buffers of the reduction are freed after each backward, as the
issue's accounting of params + grad shard + masters + moments assumes). Each configuration
runs in fresh ranks.
``extra_info`` holds ``w<world>_<params>_<moments>_live`` / ``..._state`` in bytes per param and
``..._step_ratio``: the median step time of the last two steps over fp32 moments' (same
params, same run; the CPU figure of the eager codec, see the optim README).

``test_bench_compact_zero2_step`` (issue 51) times the whole training step (``zero_grad``,
forward, backward, ``step``; batch 32) of three systems built side by side in the same two ranks
(world 2, Gloo, one thread each, AdamW ``fused=True``, ``ShardedDataParallel`` defaults): fp32
moments, int8 moments with the compiled step (the default) and int8 with the eager step
(``compact_compile=False``), interleaved round robin (the order rotated every round, a barrier
before each step); the figure is the median over rounds of ``t_int8 / t_fp32`` within a round,
with the quartiles, and the compiled system's first step (compilation) over its median step.

Run with ``python tools/bench.py ddp`` (the memory one: about 16 minutes on a 2-core CPU; the
step one: about 3).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from shardkit.testing import free_port
from torch import nn


def _worker(
    rank: int, world: int, port: int, kind: str | None, masters: str, lean: bool, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer
    from shardkit.testing import live_storages

    torch.manual_seed(0)
    dtype = torch.bfloat16 if masters else torch.float32  # masters: "", "fp32" or "remainder"
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).to(dtype)
    n = sum(p.numel() for p in model.parameters())
    opt = ShardedOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=1e-4,
        compact_state=kind,
        master_dtype=torch.float32 if masters else None,
        master_remainder=masters == "remainder",
    )
    sdp = ShardedDataParallel(model, opt, keep_staging_buffers=not lean)
    times = []
    for step in range(4):
        x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(step)).to(dtype)
        opt.zero_grad()
        sdp(x).float().square().mean().backward()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    sdp.wait_params()
    live = sum(live_storages(extra=[p.grad for p in model.parameters()]).values())
    state = opt.driver.stepper.state_bytes()  # type: ignore[union-attr]
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"live": live / n, "state": state / n, "step": sorted(times[2:])[0]}, f)
    dist.barrier()
    dist.destroy_process_group()


def _measure(world: int, kind: str | None, masters: str, lean: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        args = (world, free_port(), kind, masters, lean, out)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        with open(out) as f:
            result: dict[str, float] = json.load(f)
    return result


def test_bench_compact_zero2_memory(benchmark: Any) -> None:
    info: dict[str, float] = {}

    def run() -> None:
        for world in (2, 4):
            for masters in ("", "fp32", "remainder"):
                base = 0.0
                for kind, lean in ((None, False), ("int8", False), ("int4", False), ("int8", True)):
                    r = _measure(world, kind, masters, lean)
                    params = {"": "fp32", "fp32": "bf16_masters", "remainder": "bf16_remainder"}
                    key = f"w{world}_{params[masters]}_{kind or 'fp32'}"
                    key += "_lean" if lean else ""
                    info[f"{key}_live"] = round(r["live"], 3)
                    info[f"{key}_state"] = round(r["state"], 3)
                    base = base or r["step"]
                    info[f"{key}_step_ratio"] = round(r["step"] / base, 2)

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(info)
    for world in (2, 4):  # the moments shrink: int8 under a third of fp32, int4 under a sixth
        for params in ("fp32", "bf16_masters", "bf16_remainder"):
            fp32 = info[f"w{world}_{params}_fp32_state"]
            assert info[f"w{world}_{params}_int8_state"] < fp32
            assert info[f"w{world}_{params}_int8_live"] < info[f"w{world}_{params}_fp32_live"]
            assert info[f"w{world}_{params}_int4_live"] < info[f"w{world}_{params}_int8_live"]


_STEP_ROUNDS = int(os.environ.get("SHARDKIT_BENCH_COMPACT_STEP_ROUNDS", "12"))


def _step_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer

    systems: dict[str, tuple[Any, Any]] = {}
    for name, kind, compiled in (
        ("fp32", None, True),
        ("int8_compiled", "int8", True),
        ("int8_eager", "int8", False),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])
        opt = ShardedOptimizer(
            model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True, compact_state=kind,
            compact_compile=compiled,
        )  # fmt: skip
        systems[name] = (ShardedDataParallel(model, opt), opt)
    x = torch.randn(32, 2048, generator=torch.Generator().manual_seed(rank))

    def step(name: str) -> float:
        sdp, opt = systems[name]
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        sdp(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - t0

    first = {name: step(name) for name in systems}  # the compiled system compiles here
    times: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for r in range(_STEP_ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(step(name))
    for sdp, _ in systems.values():
        sdp.wait_params()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"first": first, "times": times}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_bench_compact_zero2_step(benchmark: Any) -> None:
    result: dict[str, Any] = {}

    def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.spawn(_step_worker, args=(2, free_port(), out), nprocs=2, join=True)
            with open(out) as f:
                result.update(json.load(f))

    benchmark.pedantic(run, rounds=1, iterations=1)
    times = result["times"]
    info: dict[str, Any] = {"rounds": len(times["fp32"])}
    for name in ("int8_compiled", "int8_eager"):
        ratios = sorted(a / b for a, b in zip(times[name], times["fp32"], strict=True))
        q = statistics.quantiles(ratios, n=4)
        info[f"{name}_step_ratio"] = round(statistics.median(ratios), 3)
        info[f"{name}_step_ratio_quartiles"] = [round(q[0], 3), round(q[2], 3)]
    for name, ts in times.items():
        info[f"{name}_step_ms"] = round(statistics.median(ts) * 1e3, 1)
    info["int8_compiled_first_step_s"] = round(result["first"]["int8_compiled"], 2)
    info["fp32_first_step_s"] = round(result["first"]["fp32"], 2)
    benchmark.extra_info.update(info)
    print(json.dumps(info, indent=1))
