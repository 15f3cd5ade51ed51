"""Live bytes per param of ZeRO-1 with ``compact_state`` (issue 40), world 2 and 4.

Gloo, torch DDP (``gradient_as_bucket_view=True``) + ``ShardedOptimizer(AdamW)``, the 33.6M-param
benchmark model (8 x ``Linear(2048, 2048)``), two steps; rank 0's live tensor storages (each
counted once, grads included: ``shardkit.testing.live_storages``) and its optimizer state,
for fp32 params, bf16 params with fp32 masters and bf16 params with remainder masters
(``master_remainder=True``), with fp32, int8 and int4 moments. Each
configuration runs in fresh ranks. ``extra_info`` holds ``<world>_<params>_<moments>_live`` and
``..._state`` in bytes per param.

Run with ``python tools/bench.py optim`` (about 3 minutes on a 2-core CPU).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from shardkit.testing import free_port
from torch import nn


def _worker(rank: int, world: int, port: int, kind: str | None, masters: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from shardkit.optim import ShardedOptimizer
    from shardkit.testing import live_storages
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    dtype = torch.bfloat16 if masters else torch.float32
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).to(dtype)
    n = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = ShardedOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=1e-4,
        compact_state=kind,
        master_dtype=torch.float32 if masters else None,
        master_remainder=masters == "remainder",
    )
    for step in range(2):
        x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(step)).to(dtype)
        ddp(x).float().square().mean().backward()
        opt.step()
    live = sum(live_storages(extra=[p.grad for p in model.parameters()]).values())
    state = 0
    for st in opt.optim.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                state += v.numel() * v.element_size()
            else:  # a CompactTensor: codes and scales
                state += int(v.nbytes)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"live": live / n, "state": state / n}, f)
    dist.barrier()
    dist.destroy_process_group()


def _measure(world: int, kind: str | None, masters: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(world, free_port(), kind, masters, out), nprocs=world, join=True)
        with open(out) as f:
            result: dict[str, float] = json.load(f)
    return result


def test_bench_compact_zero1_memory(benchmark: Any) -> None:
    info: dict[str, float] = {}

    def run() -> None:
        for world in (2, 4):
            for masters in ("", "fp32", "remainder"):
                for kind in (None, "int8", "int4"):
                    r = _measure(world, kind, masters)
                    params = {"": "fp32", "fp32": "bf16_masters", "remainder": "bf16_remainder"}
                    key = f"w{world}_{params[masters]}_{kind or 'fp32'}"
                    info[f"{key}_live"] = round(r["live"], 3)
                    info[f"{key}_state"] = round(r["state"], 3)

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(info)
    for world in (2, 4):  # the moments shrink: int8 under a third of fp32, int4 under a sixth
        fp32 = info[f"w{world}_fp32_fp32_state"]
        assert info[f"w{world}_fp32_int8_state"] < fp32 / 3
        assert info[f"w{world}_fp32_int4_state"] < fp32 / 6
