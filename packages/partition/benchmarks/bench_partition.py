"""Benchmarks: imbalance on the shipped shape files, and partition time for 10,000 params.

The imbalance table covers every shipped shape file at world 2, 4, 8, 16, 32 and 64 (the
README's table); the sweep over every world 2 to 64 prints, per shape file, where each
algorithm misses the 1.01 target in the issue's scope (largest parameter at most half the
mean load). Timings cover random sizes and 10,000-param block stacks dominated by repeated
identical sizes (ViT-L/16 blocks, Mixtral-style experts, a grouped-query-attention decoder).

Run from the repo root:
    python3 -m pytest -o python_files='bench_*.py' packages/partition/benchmarks -q -s

References in the same run: fairscale's ``OSS.partition_parameters`` and torch's
``ZeroRedundancyOptimizer._partition_parameters`` (both run on meta tensors in a 1-rank Gloo
group with their ``world_size`` attribute set to the target size: their partitioning reads
nothing else from the group).
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from shardkit.partition import (
    ParamSpec,
    available_shapes,
    load_shapes,
    param_costs,
    partition,
)
from shardkit.partition._algorithms import _loads
from shardkit.partition._format import _imbalance

WORLDS = (2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group() -> Iterator[None]:
    created = False
    if not dist.is_initialized():
        with tempfile.NamedTemporaryFile() as f:
            name = f.name
        dist.init_process_group("gloo", init_method=f"file://{name}", rank=0, world_size=1)
        created = True
    yield
    if created:
        dist.destroy_process_group()


def _meta(specs: tuple[ParamSpec, ...] | list[ParamSpec]) -> list[torch.nn.Parameter]:
    return [
        torch.nn.Parameter(torch.empty(s.shape, dtype=s.dtype, device="meta"), s.requires_grad)
        for s in specs
    ]


def _owners(per_rank: list[list[dict]], params: list[torch.nn.Parameter]) -> list[int]:
    ids = {id(p): i for i, p in enumerate(params)}
    out = [-1] * len(params)
    for r, groups in enumerate(per_rank):
        for g in groups:
            for p in g["params"]:
                out[ids[id(p)]] = r
    return out


def _fairscale(params: list[torch.nn.Parameter]) -> Callable[[int], list[int]]:
    from fairscale.optim import OSS

    oss = OSS(params, optim=torch.optim.SGD, lr=0.1)

    def run(world: int) -> list[int]:
        oss.world_size = world
        oss._partition_parameters = []
        return _owners(oss.partition_parameters(), params)

    return run


def _torch_zero(params: list[torch.nn.Parameter]) -> Callable[[int], list[int]]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)

    def run(world: int) -> list[int]:
        zero.world_size = world
        zero._partition_parameters_cache = []
        return _owners(zero._partition_parameters(), params)

    return run


def test_imbalance_table(benchmark: pytest.FixtureRequest) -> None:
    rows: list[str] = []
    worst: dict[str, float] = {}
    for name in available_shapes():
        specs = load_shapes(name).specs
        costs = param_costs(specs)
        params = _meta(specs)
        refs = {"fairscale OSS": _fairscale(params), "torch ZeRO": _torch_zero(params)}
        for w in WORLDS:
            cells: dict[str, float] = {}
            for ref_name, run in refs.items():
                cells[ref_name] = _imbalance(_loads(costs, run(w), w))
            for algo in ("greedy", "sorted_greedy", "balanced"):
                cells[algo] = partition(specs, w, algorithm=algo).imbalance
            bound = partition(specs, w).bound  # max(largest param, mean) / mean
            assert cells["balanced"] <= cells["sorted_greedy"]
            if bound <= 1.0:
                worst[f"{name}@{w}"] = cells["balanced"]
            rows.append(
                f"| {name} | {w} | "
                + " | ".join(f"{cells[k]:.4f}" for k in cells)
                + f" | {bound:.4f} |"
            )
    header = (
        "| model | world | fairscale OSS | torch ZeRO | greedy | sorted_greedy | balanced "
        "| lower bound |\n|---|---|---|---|---|---|---|---|"
    )
    print("\n" + header + "\n" + "\n".join(rows))
    print("worst balanced where the largest param allows 1.0:", max(worst.values()))
    benchmark.extra_info["worst_balanced_when_unbounded"] = max(worst.values())
    benchmark.pedantic(lambda: None, rounds=1)


def test_target_sweep(benchmark: pytest.FixtureRequest) -> None:
    # Every world 2-64 where the largest param is at most half the mean load (the issue's
    # scope for the 1.01 target): per shape file, how many such worlds each algorithm misses
    # 1.01 at, and its worst imbalance there; "gap" is balanced's max load over the lower
    # bound max(largest param, mean) at its worst world.
    print(
        "\n| model | worlds in scope | greedy > 1.01 | sorted_greedy > 1.01 | balanced > 1.01 "
        "| balanced worst (world) |\n|---|---|---|---|---|---|"
    )
    totals = {"greedy": 0, "sorted_greedy": 0, "balanced": 0}
    for name in available_shapes():
        specs = load_shapes(name).specs
        costs = param_costs(specs)
        scope = [w for w in range(2, 65) if max(costs) <= math.fsum(costs) / w / 2]
        misses: dict[str, list[tuple[float, int]]] = {a: [] for a in totals}
        for w in scope:
            for algo in totals:
                imb = partition(specs, w, algorithm=algo).imbalance
                if imb > 1.01:
                    misses[algo].append((imb, w))
        for algo in totals:
            totals[algo] += len(misses[algo])
        worst = max(misses["balanced"], default=None)
        cell = f"{worst[0]:.4f} ({worst[1]})" if worst else "-"
        print(
            f"| {name} | {len(scope)} | "
            + " | ".join(str(len(misses[a])) for a in totals)
            + f" | {cell} |"
        )
    print("misses over all shape files:", totals)
    for algo, n in totals.items():
        benchmark.extra_info[f"{algo}_misses_1_01"] = n
    benchmark.pedantic(lambda: None, rounds=1)


def _vit_blocks(blocks: int) -> list[int]:
    d, ff = 1024, 4096  # ViT-L/16 blocks: qkv, proj, fc1, fc2, biases, norms
    out = [d, 197 * d, d * 768, d]
    for _ in range(blocks):
        out += [d, d, 3 * d * d, 3 * d, d * d, d, d, d, ff * d, ff, d * ff, d]
    return [*out, d, d, 1000 * d, 1000]


def _moe_blocks(layers: int, experts: int) -> list[int]:
    d, ff, kv = 4096, 14336, 1024  # Mixtral-style: GQA attention, router, SwiGLU experts
    out = [32000 * d]
    for _ in range(layers):
        out += [d * d, kv * d, kv * d, d * d, experts * d, *[ff * d] * (3 * experts), d, d]
    return [*out, d, 32000 * d]


def _gqa_blocks(layers: int) -> list[int]:
    d, ff, kv = 4096, 14336, 1024  # Mistral-style decoder with grouped-query attention
    out = [32000 * d]
    for _ in range(layers):
        out += [d * d, kv * d, kv * d, d * d, d, ff * d, ff * d, d * ff, d]
    return [*out, d, 32000 * d]


def _ten_thousand(workload: str) -> list[ParamSpec]:
    rng = random.Random(0)
    if workload in _STACKS:
        return [ParamSpec((n,), torch.bfloat16) for n in _STACKS[workload]()]
    if workload == "loguniform":
        # Heavy-tailed sizes like real models: log-uniform from 1 to 4M elements.
        sizes = [int(2 ** rng.uniform(0, 22)) for _ in range(10_000)]
    else:
        # Uniform sizes: LPT stays measurably above the bound, so local improvement runs.
        sizes = [rng.randint(1, 10**6) for _ in range(10_000)]
    return [ParamSpec((n,), torch.float32) for n in sizes]


_STACKS = {
    "vit-blocks": lambda: _vit_blocks(833),  # 10,004 params
    "moe-blocks": lambda: _moe_blocks(52, 64),  # 10,351 params
    "gqa-blocks": lambda: _gqa_blocks(1111),  # 10,002 params
}
WORKLOADS = ("loguniform", "uniform", *_STACKS)


def _min_ms(fn: Callable[[], object], rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("algo", ["greedy", "sorted_greedy", "balanced"])
def test_time_10k_ours(
    benchmark: pytest.FixtureRequest, algo: str, world: int, workload: str
) -> None:
    specs = _ten_thousand(workload)
    benchmark.group = f"10k params ({workload}), world {world}"
    result = benchmark(partition, specs, world, algorithm=algo)
    benchmark.extra_info["imbalance"] = result.imbalance
    if algo == "balanced":
        # The same run's LPT (sorted_greedy) on the same input: balanced's extra cost as a
        # ratio, and its gain as max load over LPT's.
        lpt = partition(specs, world, algorithm="sorted_greedy")
        lpt_ms = _min_ms(lambda: partition(specs, world, algorithm="sorted_greedy"))
        bal_ms = _min_ms(lambda: partition(specs, world, algorithm="balanced"))
        benchmark.extra_info["time_over_sorted_greedy"] = bal_ms / lpt_ms
        benchmark.extra_info["max_load_over_sorted_greedy"] = max(result.loads) / max(lpt.loads)
        benchmark.extra_info["max_load_over_lower_bound"] = max(result.loads) / result.lower_bound


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("ref", ["fairscale OSS", "torch ZeRO"])
def test_time_10k_reference(
    benchmark: pytest.FixtureRequest, ref: str, world: int, workload: str
) -> None:
    specs = _ten_thousand(workload)
    params = _meta(specs)
    run = _fairscale(params) if ref == "fairscale OSS" else _torch_zero(params)
    benchmark.group = f"10k params ({workload}), world {world}"
    owners = benchmark(run, world)
    costs = param_costs(specs)
    benchmark.extra_info["imbalance"] = _imbalance(_loads(costs, owners, world))
