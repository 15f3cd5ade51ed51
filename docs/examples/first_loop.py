#!/usr/bin/env python3
"""A first sharded training loop: plain DDP + shardkit.optim.ShardedOptimizer (ZeRO-1).

Runs as is on a laptop (two local Gloo ranks on the CPU) and unchanged under torchrun:

    python docs/examples/first_loop.py                       # spawns 2 local ranks
    torchrun --nproc-per-node 4 docs/examples/first_loop.py  # NCCL if GPUs are visible

It trains a small regression model, clips gradients by the global norm, steps an LR scheduler,
prints each rank's share of the optimizer state, then writes both checkpoint kinds: a sharded
one (every rank writes its shard; reloads at any world size) and one plain torch optimizer state
dict (loads into torch.optim.AdamW without shardkit).
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from shardkit.optim import ShardedOptimizer, load_sharded, save_sharded
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(out: Path, steps: int = 30) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", rank % torch.cuda.device_count())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    torch.manual_seed(0)  # same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 1),
    ).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    # 1. Wrap the optimizer class, not an instance: each rank builds AdamW over the params it owns.
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)  # any torch scheduler

    g = torch.Generator().manual_seed(1234 + rank)  # each rank draws its own data
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(steps):
        x = torch.randn(64, 32, generator=g)
        y = x @ w_true + 0.01 * torch.randn(64, 1, generator=g)
        loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients, as usual
        opt.clip_grad_norm(1.0)  # 2. global norm over all shards (one all-reduce)
        opt.step()  # 3. step the owned shard, broadcast the updated params
        sched.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    # 4. Each rank holds the AdamW state of only the params it owns.
    mine = sum(
        t.numel() * t.element_size()
        for st in opt.optim.state.values()
        for t in st.values()
        if torch.is_tensor(t)
    )
    full = sum(2 * p.numel() * 4 for p in model.parameters())  # exp_avg + exp_avg_sq in fp32
    print(
        f"rank {rank}/{world}: owns {len(opt.owned_params)} params, optimizer state {mine / full:.2f}x of plain AdamW"
    )

    # 5. Sharded checkpoint (collective; reloads at any world size) ...
    save_sharded(opt, out / "optim")
    load_sharded(opt, out / "optim")
    # ... or one plain torch file, for tools that know nothing about shardkit.
    opt.consolidate_state_dict(recipient_rank=0)  # collective: every rank calls it
    if rank == 0:
        torch.save(opt.state_dict(), out / "adamw.pt")
        plain = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        plain.load_state_dict(torch.load(out / "adamw.pt", weights_only=True))
        print(f"rank 0: wrote {out / 'adamw.pt'}, loaded into a plain torch.optim.AdamW")
    dist.barrier()


def _spawned(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        train(Path(out))
    finally:
        dist.destroy_process_group()


def main() -> int:
    if "RANK" in os.environ:  # launched by torchrun: one process per rank
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        out = Path(os.environ.get("OUT", "first-loop-out"))
        out.mkdir(parents=True, exist_ok=True)
        try:
            train(out)
        finally:
            gc.collect()  # the wrappers' reference cycles hold the group: free it before exit
            dist.destroy_process_group()
        return 0
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(world, str(Path(tmp) / "init"), tmp), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
