"""Bytes Gloo actually puts on the wire per rank per step, measured in a private network namespace.

Each (implementation, world) runs in its own network namespace (``unshare -n``, loopback only,
so root or an unprivileged user namespace is needed), where the ``lo`` line of
``/proc/net/dev`` counts every byte this experiment's processes send to each other (TCP/IP
headers and ACKs included) and nothing else. Ranks are spawned with ``torch.multiprocessing``
on Gloo, model and batch as ``bench_ddp.py`` (6 x Linear(W, W) + GELU, batch 16, AdamW).

Method: after 3 warm-up steps, rank 0 reads the transmitted bytes of ``lo`` around ``K`` steps
each followed by a barrier, then around ``K`` barriers alone; the difference divided by ``K``
and by the world size is the wire bytes per rank per step (the rendezvous store and barriers
cancel out). Implementations: plain DDP + AdamW, shardkit ``ShardedDataParallel`` +
``ShardedOptimizer(AdamW)`` with the exact wire and with ``wire="int8"`` / ``"int4"``, torch
``ZeroRedundancyOptimizer(AdamW)`` + DDP; and each
collective alone on a model-sized fp32 buffer (``collectives``), to compare Gloo's algorithms
with the ring model (reduce-scatter and all-gather ``(N-1)/N`` of the buffer per rank,
all-reduce ``2(N-1)/N``, broadcast ``(N-1)/N``; see [Note: Byte accounting] in
``shardkit.optim._wire``).

Not collected by pytest. Run: ``python packages/ddp/benchmarks/wire_bytes.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ddp import _WIDTH, _batch, _model, _port

_K = int(os.environ.get("SHARDKIT_WIRE_STEPS", "10"))
_WARMUP = 3
_IMPLS = ("ddp", "shardkit", "shardkit_int8", "shardkit_int4", "torch_zero", "collectives")


def _lo_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # rx: 8 fields, then tx bytes
    raise RuntimeError("no lo line in /proc/net/dev")


def _measure(world: int, step: Callable[[], object]) -> float:
    """Wire bytes per rank of one ``step()`` (see the module docstring)."""
    for _ in range(_WARMUP):
        step()
    dist.barrier()
    dist.barrier()
    c0 = _lo_tx_bytes()
    for _ in range(_K):
        step()
        dist.barrier()
    dist.barrier()
    c1 = _lo_tx_bytes()
    for _ in range(_K):
        dist.barrier()
    dist.barrier()
    c2 = _lo_tx_bytes()
    return ((c1 - c0) - (c2 - c1)) / _K / world


def _train(rank: int, world: int, impl: str) -> dict[str, Any]:
    m = _model()
    model_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    ring = (world - 1) / world
    x = _batch(rank)
    if impl.startswith("shardkit"):
        from shardkit.ddp import ShardedDataParallel
        from shardkit.optim import ShardedOptimizer

        wire = impl.removeprefix("shardkit").removeprefix("_") or "exact"
        opt: Any = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        net: Any = ShardedDataParallel(m, opt, broadcast_buffers=False, wire=wire)
    else:
        net = DDP(m)
        if impl == "ddp":
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
            )

    def step() -> None:
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(_WARMUP):
        step()
    if impl.startswith("shardkit"):
        net.comm_stats.reset()
        sent = _measure(world, step)
        ring_bytes = net.comm_stats.total_bytes() / (_WARMUP + _K)
    else:
        sent = _measure(world, step)
        ring_bytes = (2 * ring + (ring if impl == "torch_zero" else 0.0)) * model_bytes
    return {"model_bytes": model_bytes, "wire": sent, "ring": ring_bytes}


def _collectives(rank: int, world: int) -> dict[str, Any]:
    n = sum(p.numel() for p in _model().parameters())
    n -= n % world
    buf = torch.randn(n)
    shard = torch.empty(n // world)
    ring = (world - 1) / world
    nbytes = n * 4
    ops: dict[str, tuple[Callable[[], object], float]] = {
        "all_reduce": (lambda: dist.all_reduce(buf), 2 * ring),
        "reduce_scatter (list)": (
            lambda: dist.reduce_scatter(shard, list(buf.chunk(world))),
            ring,
        ),
        "reduce_scatter_tensor": (lambda: dist.reduce_scatter_tensor(shard, buf), ring),
        "all_gather (list)": (lambda: dist.all_gather(list(buf.chunk(world)), shard), ring),
        "all_gather_into_tensor": (lambda: dist.all_gather_into_tensor(buf, shard), ring),
        "broadcast": (lambda: dist.broadcast(buf, src=0), ring),
    }
    out: dict[str, Any] = {}
    for name, (fn, factor) in ops.items():
        wire = _measure(world, fn)
        out[name] = {"wire": wire, "ring": factor * nbytes, "buffer_bytes": nbytes}
    return out


def _worker(rank: int, world: int, port: int, impl: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _collectives(rank, world) if impl == "collectives" else _train(rank, world, impl)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _one(impl: str, world: int, out: str) -> None:
    mp.spawn(_worker, args=(world, _port(), impl, out), nprocs=world, join=True)


def _in_namespace(impl: str, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        cmd = f"ip link set lo up && exec {sys.executable} {os.path.abspath(__file__)} " + (
            f"--one {impl} {world} {out}"
        )
        subprocess.run(["unshare", "-n", "sh", "-c", cmd], check=True)
        with open(out) as f:
            return dict(json.load(f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=3, metavar=("IMPL", "WORLD", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--worlds", default="2,4")
    args = ap.parse_args()
    if args.one:
        _one(args.one[0], int(args.one[1]), args.one[2])
        return
    results: dict[str, Any] = {
        "method": (
            f"unshare -n private network namespace, /proc/net/dev lo tx bytes over {_K} steps "
            f"(each + barrier) minus {_K} barriers, / world / steps; Gloo on CPU, "
            f"torch.multiprocessing spawn, model 6 x Linear({_WIDTH}, {_WIDTH}) fp32, batch 16, "
            f"AdamW; TCP/IP headers and ACKs included"
        ),
        "torch": torch.__version__,
    }
    for world in (int(w) for w in args.worlds.split(",")):
        per: dict[str, Any] = {}
        for impl in _IMPLS:
            per[impl] = _in_namespace(impl, world)
        ddp_wire, ddp_ring = per["ddp"]["wire"], per["ddp"]["ring"]
        table: dict[str, dict[str, float]] = {}
        for impl in ("ddp", "shardkit", "shardkit_int8", "shardkit_int4", "torch_zero"):
            r = per[impl]
            table[impl] = {
                "wire_bytes_per_rank_step": r["wire"],
                "ring_bytes_per_rank_step": r["ring"],
                "wire_vs_ddp_wire": r["wire"] / ddp_wire,
                "ring_vs_ddp_ring": r["ring"] / ddp_ring,
                "wire_vs_own_ring": r["wire"] / r["ring"],
            }
        coll = {
            name: {
                "wire_bytes_per_rank": c["wire"],
                "ring_bytes_per_rank": c["ring"],
                "wire_vs_ring": c["wire"] / c["ring"],
            }
            for name, c in per["collectives"].items()
        }
        results[f"world{world}"] = {
            "model_bytes": per["ddp"]["model_bytes"],
            "steps": table,
            "collectives": coll,
        }
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
