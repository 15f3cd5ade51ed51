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

Run with ``python tools/bench.py ddp`` (this one: about 16 minutes on a 2-core CPU).
"""

from __future__ import annotations

import json
import os
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
