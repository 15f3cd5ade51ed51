"""What the param-access guard costs (issue 35; [Note: Param access guard] in shardkit.optim._gather).

With ``overlap_param_gather=True`` (default) a ``TorchFunctionMode`` sees every torch function
on the training thread from the end of ``step()`` until the last param gather is waited for.
This benchmark measures its cost at world 2 (Gloo, CPU, one thread per rank, AdamW fused) on
two models, the systems benchmark's 8 x Linear(2048) (33.6M params) and a small 6 x
Linear(512) (1.6M params), batch 32:

- ``calls`` / ``inspected`` per step: torch functions that passed through the guard, and those
  whose arguments it matched against the pending buckets (the others are metadata reads, or
  came after the last gather);
- ``us_per_inspected`` / ``us_per_call``: the guard's own time per call, measured apart (one
  process, a loop of ``t.add_(0)`` on a tensor outside the buckets with a gather pending, and
  of ``t.shape`` (a metadata read), minus the same loop without the guard);
- ``guard_ms`` / ``guard_pct``: per step, ``inspected * us_per_inspected + (calls -
  inspected) * us_per_call``, and that as a share of the default step time;
- ``step_vs_unguarded``: the step time of the default against the same wrapper with the guard
  never armed (stale reads possible: the loop does not read params after ``step()``), and
  ``step_vs_ddp`` against torch DDP + AdamW fused (``gradient_as_bucket_view=True``); each
  round runs two steps of each system in a row and times the second (whose forward meets the
  first's pending gathers), systems in a rotated order; median of per-round ratios with
  quartiles.

Run: ``python -m pytest -o python_files='bench_*.py' packages/ddp/benchmarks/bench_guard.py -q -s``.
Times on this box are ratios within one run; absolute times count only from a GPU.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

_MODELS = {"benchmark": (8, 2048), "small": (6, 512)}
_ROUNDS = int(os.environ.get("SHARDKIT_BENCH_GUARD_ROUNDS", "24"))
_BATCH = 32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _per_call_us() -> tuple[float, float]:
    """The guard's own time per inspected call and per metadata call (microseconds)."""
    from shardkit.optim._gather import _ParamGuard, _Spans

    class _Pending:
        """A gather pending on a bucket the loop's tensor is not in: every call is matched,
        none waits."""

        def __init__(self) -> None:
            self.flat = torch.zeros(1024)
            self.pending = {0: None}
            self.spans = _Spans([(0, self.flat)])

        def forget_finished(self) -> None:
            pass

    guard = _ParamGuard()
    pending = _Pending()
    guard.refs.append(weakref.ref(pending))  # type: ignore[arg-type]
    t = torch.zeros(16)  # not in the bucket: matched, never waited for
    n = 20000

    def loop(fn: Any) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, time.perf_counter() - t0)
        return best / n * 1e6

    op, meta = (lambda: t.add_(0)), (lambda: t.shape)
    bare_op, bare_meta = loop(op), loop(meta)
    with guard:
        guarded_op, guarded_meta = loop(op), loop(meta)
    return max(0.0, guarded_op - bare_op), max(0.0, guarded_meta - bare_meta)


def _run(rank: int, world: int, layers: int, width: int) -> dict[str, Any]:
    import shardkit.optim._gather as gather_module
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer

    fused = {"lr": 1e-4, "fused": True}
    systems: dict[str, tuple[nn.Module, Any]] = {}
    m = _model(layers, width)
    systems["ddp"] = (
        DDP(m, gradient_as_bucket_view=True),
        torch.optim.AdamW(m.parameters(), **fused),
    )
    for name in ("guarded", "unguarded"):
        m = _model(layers, width)
        opt = ShardedOptimizer(m.parameters(), torch.optim.AdamW, **fused)
        systems[name] = (ShardedDataParallel(m, opt, broadcast_buffers=False), opt)
    real_arm = gather_module.arm
    x = torch.randn(_BATCH, width, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {k: [] for k in systems}
    calls: list[int] = []
    inspected: list[int] = []
    names = list(systems)
    for r in range(_ROUNDS + 1):
        for name in names[r % 3 :] + names[: r % 3]:
            model, opt = systems[name]
            gather_module.arm = real_arm if name != "unguarded" else (lambda gather: None)
            # two steps in a row, the second timed: its forward meets the first's gathers
            for timed in (False, True):
                guard = getattr(gather_module._local, "guard", None)
                c0, i0 = (guard.calls, guard.inspected) if guard is not None else (0, 0)
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                if r and timed:
                    times[name].append(time.perf_counter() - t0)
                    if name == "guarded":
                        guard = gather_module._local.guard
                        calls.append(guard.calls - c0)
                        inspected.append(guard.inspected - i0)
    gather_module.arm = real_arm
    for model, _ in systems.values():
        if isinstance(model, ShardedDataParallel):
            model.wait_params()
    us_inspected, us_call = _per_call_us()
    per_step_calls = statistics.median(calls)
    per_step_inspected = statistics.median(inspected)
    guard_ms = (
        per_step_inspected * us_inspected + (per_step_calls - per_step_inspected) * us_call
    ) / 1e3
    step_ms = statistics.median(times["guarded"]) * 1e3

    def quartiles(a: str, b: str) -> list[float]:
        ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
        q = statistics.quantiles(ratios, n=4, method="inclusive")
        return [q[0], statistics.median(ratios), q[-1]]

    return {
        "params": sum(p.numel() for p in _model(layers, width).parameters()),
        "calls": per_step_calls,
        "inspected": per_step_inspected,
        "us_per_inspected": us_inspected,
        "us_per_call": us_call,
        "guard_ms": guard_ms,
        "step_ms": step_ms,
        "guard_pct": 100 * guard_ms / step_ms,
        "step_vs_unguarded": quartiles("guarded", "unguarded"),
        "step_vs_ddp": quartiles("guarded", "ddp"),
        "unguarded_vs_ddp": quartiles("unguarded", "ddp"),
    }


def _worker(rank: int, world: int, port: int, layers: int, width: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _run(rank, world, layers, width)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model", list(_MODELS))
def test_bench_guard(benchmark: Any, model: str) -> None:
    layers, width = _MODELS[model]
    results: dict[str, Any] = {}

    def run() -> None:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            mp.spawn(_worker, args=(2, _port(), layers, width, out), nprocs=2, join=True)
            with open(out) as f:
                results.update(json.load(f))

    benchmark.pedantic(run, rounds=1, iterations=1)
    info = benchmark.extra_info
    for key in ("step_vs_unguarded", "step_vs_ddp", "unguarded_vs_ddp"):
        q1, med, q3 = results[key]
        info[key] = med
        info[f"{key}_q1"] = q1
        info[f"{key}_q3"] = q3
    for key in ("calls", "inspected", "us_per_inspected", "us_per_call", "guard_ms", "guard_pct"):
        info[key] = results[key]
    info["model"] = (
        f"{layers} x Linear({width}), {results['params']:,} params, batch {_BATCH}, AdamW fused, "
        f"Gloo CPU, world 2, {_ROUNDS} rounds"
    )
    print(json.dumps(results, indent=1))
