"""Cost of one call agreement (every ``step()`` makes one): the c10d store (this version)
against the Gloo side-group all-reduce it replaced (0.3.2 and earlier, reproduced here as it
was: one all-reduce (MAX) of six int64s on a Gloo group over the same ranks, issued async and
waited with the timeout).

One spawned world per case (``env://``, so a TCPStore served by rank 0's process, as
``init_process_group`` does outside torchrun; torchrun serves it from its agent), world 2 and 4,
plus a FileStore world 2 (``init_method="file://..."``). The two mechanisms run in alternating
blocks of ``SHARDKIT_BENCH_AGREE_CALLS`` calls (default 200), ``SHARDKIT_BENCH_AGREE_ROUNDS``
rounds (default 5), each block started by a barrier; every call is timed on its own and the
median over all calls of all ranks is reported in microseconds (``extra_info``), with the
ratio new/old. CPU only: the agreement never touches a GPU.

Run with ``python3 -m pytest -o python_files='bench_*.py' packages/optim/benchmarks/bench_agreement.py -q -s``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_TIMEOUT = timedelta(seconds=30)


def _side_group_agreement(side: dist.ProcessGroup, code: int, digest: int) -> None:
    """shardkit-optim 0.3.2's agreement transport (its ``agree_call``, less the messages)."""
    flags = torch.tensor([code, -code, digest, -digest, 0, 0], dtype=torch.int64)
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=side, async_op=True)
    if work is not None:
        work.wait(_TIMEOUT)
    hi, lo, *_ = flags.tolist()
    if hi != -lo:
        raise RuntimeError("ranks in different calls")


def _worker(
    rank: int, port: int, out: str, world: int, store: str, calls: int, rounds: int
) -> None:
    from shardkit.optim import agree_call
    from shardkit.optim._agreement import _CALLS, _code
    from shardkit.optim._agreement import channel

    torch.set_num_threads(1)
    if store == "file":
        dist.init_process_group(
            "gloo", init_method=f"file://{out}.store", rank=rank, world_size=world
        )
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    side = dist.new_group(list(range(world)), backend="gloo")
    channel(group)  # made once, as ShardedOptimizer's constructor does
    code = _code(_CALLS[0])
    runs = {
        "store": lambda: agree_call(_CALLS[0], group, _TIMEOUT, digest=12345),
        "side_group_allreduce": lambda: _side_group_agreement(side, code, 12345),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up: connections, first keys
        for _ in range(20):
            fn()
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            dist.barrier()
            fn = runs[name]
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        merged = {name: [t for g in gathered for t in g[name]] for name in runs}
        with open(out, "w") as f:
            json.dump({name: statistics.median(ts) * 1e6 for name, ts in merged.items()}, f)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, store: str) -> dict[str, float]:
    calls = int(os.environ.get("SHARDKIT_BENCH_AGREE_CALLS", "200"))
    rounds = int(os.environ.get("SHARDKIT_BENCH_AGREE_ROUNDS", "5"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(_worker, args=(port, out, world, store, calls, rounds), nprocs=world, join=True)
        with open(out) as f:
            res: dict[str, float] = json.load(f)
            return res


@pytest.mark.parametrize(("world", "store"), [(2, "tcp"), (4, "tcp"), (2, "file")])
def test_bench_call_agreement(benchmark: Any, world: int, store: str) -> None:
    """Median microseconds per call agreement: the store exchange against the side-group
    all-reduce of 0.3.2, interleaved in the same processes."""
    results: dict[str, float] = {}
    benchmark.pedantic(lambda: results.update(_spawn(world, store)), rounds=1)
    info = benchmark.extra_info
    info["store_us"] = results["store"]
    info["side_group_allreduce_us"] = results["side_group_allreduce"]
    info["ratio_store_vs_side_group"] = results["store"] / results["side_group_allreduce"]
    print(json.dumps({"world": world, "store": store, **results}, indent=1))
