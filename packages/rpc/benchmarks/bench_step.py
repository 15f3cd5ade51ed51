"""Step latency and trainer throughput: shardkit.rpc vs torch's DistributedOptimizer.

Setup (every case): 3 processes over TensorPipe on localhost; worker0 is the trainer, the model
is one parameter of ``numel / 2`` elements on each of the 2 owner workers (worker1, worker2).
A training step is: forward (one RPC per owner, ``(p * 1).sum()`` computed on the owner), the
distributed backward, then ``opt.step(context_id)`` with SGD(lr=1). torch's DistributedOptimizer
takes its default path for SGD (the TorchScript functional optimizer, no lock).

Measured on the trainer, alternating torch / shardkit blocks in one run to share the noise:
- step latency: median seconds of ``opt.step(context_id)`` alone, per thread;
- throughput: full training steps per second over all trainer threads;
- lost updates: the gradient is constant (1 per element), so after N applied steps every element
  is exactly -N; how many updates the worst element lacks.

Ratios are shardkit / torch (latency: lower is better, goal <= 1.5; throughput: higher is
better, goal >= 1.0 with 4 trainer threads), paired by round: round r runs one torch block and one
shardkit block back to back (order alternating), the round's ratio compares those two blocks, and
the figure is the median over the rounds, with the quartiles of the per-round ratios beside it
(see [Note: Paired rounds]). With several threads torch's steps run concurrently
and unlocked (and may lose updates), shardkit's are serialised per owner (exact), so the
throughput ratio there prices exactness. ``test_lost_updates`` counts lost updates under 4 and 8
concurrent trainers (see [Note: Lost-update benchmark]).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from shardkit.rpc import DistributedOptimizer

_PATH = os.path.abspath(__file__)
_PARAMS: dict[str, torch.nn.Parameter] = {}
_ONES: dict[int, torch.Tensor] = {}


def _make(tag: str, numel: int) -> Any:
    _PARAMS[tag] = torch.nn.Parameter(torch.zeros(numel))
    _ONES.setdefault(numel, torch.ones(numel))
    return rpc.RRef(_PARAMS[tag])


def _forward(tag: str) -> torch.Tensor:
    p = _PARAMS[tag]
    return (p * _ONES[p.numel()]).sum()


def _min_value(tag: str) -> float:
    return float(_PARAMS.pop(tag).detach().min())


def _optimizer(impl: str, rrefs: list[Any]) -> Any:
    if impl == "shardkit":
        return DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
    from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return TorchDistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)


def _block(impl: str, tag: str, numel: int, threads: int, steps: int) -> dict[str, float]:
    """``threads`` trainer threads x ``steps`` steps with a fresh model and optimizer."""
    owners = ("worker1", "worker2")
    tags = [f"{tag}-{owner}" for owner in owners]
    rrefs = [
        rpc.rpc_sync(o, _make, args=(t, numel // 2)) for o, t in zip(owners, tags, strict=True)
    ]
    opt = _optimizer(impl, rrefs)
    latencies: list[float] = []
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            for _ in range(steps):
                with dist_autograd.context() as cid:
                    futs = [
                        rpc.rpc_async(o, _forward, args=(t,))
                        for o, t in zip(owners, tags, strict=True)
                    ]
                    loss = torch.stack([f.wait() for f in futs]).sum()
                    dist_autograd.backward(cid, [loss])
                    start = time.perf_counter()
                    opt.step(cid)
                    latencies.append(time.perf_counter() - start)
        except BaseException as err:
            errors.append(err)

    pool = [threading.Thread(target=trainer) for _ in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    total = threads * steps
    lost = max(
        total + rpc.rpc_sync(o, _min_value, args=(t,)) for o, t in zip(owners, tags, strict=True)
    )
    return {
        "latency": statistics.median(latencies),
        "throughput": total / elapsed,
        "lost": lost,
    }


def _body_compare(rank: int, numel: int, threads: int, steps: int, rounds: int) -> Any:
    if rank != 0:
        return None
    _block("torch", "warm-t", numel, 1, 3)  # compile / first-touch costs out of the figures
    _block("shardkit", "warm-s", numel, 1, 3)
    runs: dict[str, list[dict[str, float]]] = {"torch": [], "shardkit": []}
    for r in range(rounds):
        for impl in ("torch", "shardkit") if r % 2 == 0 else ("shardkit", "torch"):
            runs[impl].append(_block(impl, f"{impl}{r}", numel, threads, steps))
    return runs


# [Note: Paired rounds]
# Three processes with TensorPipe's threads share the machine's cores, so one block's speed
# depends on what the scheduler did during that second: on the shared 2-core VM, whole-run medians
# of 4 blocks per implementation moved the 4-thread throughput ratio between 0.57 and 1.89 from
# one run to the next. Each round therefore runs one block of each implementation back to back
# (alternating which goes first), the ratio is taken within the round, where both blocks saw the
# same conditions, and the figure is the median of those ratios over many short rounds; the
# quartiles show how far single rounds spread.
def _summary(runs: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    torch_b, shard_b = runs["torch"], runs["shardkit"]
    out: dict[str, float] = {}
    for key, figure in (("latency", "step_latency"), ("throughput", "throughput")):
        ratios = sorted(s[key] / t[key] for s, t in zip(shard_b, torch_b, strict=True))
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        out[f"{figure}_ratio_vs_torch"] = statistics.median(ratios)
        out[f"{figure}_ratio_vs_torch_q1"] = q1  # tools/bench.py draws these as whiskers
        out[f"{figure}_ratio_vs_torch_q3"] = q3
    out["shardkit_step_latency_ms"] = statistics.median(b["latency"] for b in shard_b) * 1e3
    out["torch_step_latency_ms"] = statistics.median(b["latency"] for b in torch_b) * 1e3
    out["shardkit_steps_per_s"] = statistics.median(b["throughput"] for b in shard_b)
    out["torch_steps_per_s"] = statistics.median(b["throughput"] for b in torch_b)
    out["shardkit_lost_updates"] = max(b["lost"] for b in shard_b)
    out["torch_lost_updates"] = max(b["lost"] for b in torch_b)
    out["shardkit_lost_updates_total"] = sum(b["lost"] for b in shard_b)
    out["torch_lost_updates_total"] = sum(b["lost"] for b in torch_b)
    out["rounds"] = len(shard_b)
    return out


_CASES = [
    pytest.param(4096, 1, 100, id="4k-params-1-thread"),
    pytest.param(4096, 4, 25, id="4k-params-4-threads"),
    pytest.param(4 * 1024 * 1024, 1, 20, id="4M-params-1-thread"),
    pytest.param(4 * 1024 * 1024, 4, 5, id="4M-params-4-threads"),
]
_ROUNDS = 32


@pytest.mark.parametrize(("numel", "threads", "steps"), _CASES)
def test_step(benchmark: Any, rpc_world: Any, numel: int, threads: int, steps: int) -> None:
    result: dict[str, Any] = {}

    def run() -> None:
        runs = rpc_world.run(_PATH, "_body_compare", numel, threads, steps, _ROUNDS, timeout=600)
        result.update(_summary(runs[0]))

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    benchmark.extra_info["load_average_1min"] = os.getloadavg()[0]
    assert result["shardkit_lost_updates"] == 0.0, result


# [Note: Lost-update benchmark]
# torch's TorchScript step takes no lock, so concurrent steps on one owner race on the in-place
# update (see [Note: Where torch's DistributedOptimizer loses updates] in the tests); the race
# shows with parameters of 2**18+ elements and many concurrent steps. This case runs 4 or 8
# trainer threads x 50 steps on 2**20 elements per owner, both implementations alternating over
# 4 blocks each, and records how many updates the worst element lacks (worst block, and the sum
# over blocks). The count is probabilistic for torch; shardkit's must be 0.
_LOST_CASES = [
    pytest.param(4, id="4-trainers"),
    pytest.param(8, id="8-trainers"),
]


@pytest.mark.parametrize("threads", _LOST_CASES)
def test_lost_updates(benchmark: Any, rpc_world: Any, threads: int) -> None:
    result: dict[str, Any] = {}

    def run() -> None:
        runs = rpc_world.run(_PATH, "_body_compare", 2 << 20, threads, 50, 4, timeout=600)
        result.update(_summary(runs[0]))

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(
        {k: v for k, v in result.items() if "latency_ratio" not in k and "_ms" not in k}
    )
    benchmark.extra_info["load_average_1min"] = os.getloadavg()[0]
    assert result["shardkit_lost_updates"] == 0.0, result
