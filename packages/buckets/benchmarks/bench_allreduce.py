"""One all-reduce of a flat ParamBucket vs one all-reduce per param (200 small params, Gloo, 2 ranks).

Rank 0 is the pytest process; rank 1 is a helper process started from this file that mirrors
every command rank 0 broadcasts. Run with:

    OMP_NUM_THREADS=1 python3 -m pytest -o python_files='bench_*.py' packages/buckets/benchmarks -q
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from shardkit.buckets import ParamBucket

_NUM_PARAMS = 200
_ITERS_PER_ROUND = 10
_STOP, _FLAT, _PER_PARAM = 0, 1, 2
_TIMEOUT = datetime.timedelta(seconds=60)


def _make_views() -> tuple[ParamBucket, list[torch.Tensor]]:
    """200 small tensors (16..1024 floats, ~100k floats in all) as views of one bucket."""
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(16, 1025, (_NUM_PARAMS,), generator=gen).tolist()
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    bucket = ParamBucket(sum(sizes), torch.float32, "cpu")
    for p in params:
        bucket.add_param(p)
    bucket.buffer.normal_(generator=gen)
    views = [p.detach() for p in params]
    return bucket, views


def _run(cmd: int, iters: int, bucket: ParamBucket, views: list[torch.Tensor]) -> None:
    for _ in range(iters):
        if cmd == _FLAT:
            dist.all_reduce(bucket.buffer)
        else:
            for v in views:
                dist.all_reduce(v)


def _serve(init_file: str) -> None:
    """Rank 1: execute the commands rank 0 broadcasts until told to stop."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=1, world_size=2, timeout=_TIMEOUT
    )
    bucket, views = _make_views()
    cmd = torch.zeros(2, dtype=torch.int64)
    try:
        while True:
            dist.broadcast(cmd, 0)
            if int(cmd[0]) == _STOP:
                break
            _run(int(cmd[0]), int(cmd[1]), bucket, views)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pair() -> Iterator[Callable[[int], None]]:
    """A 2-rank Gloo group (this process is rank 0); yields ``run(cmd)`` for one round."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    tmp = tempfile.mkdtemp(prefix="shardkit-bench-")
    init_file = os.path.join(tmp, "init")
    helper = subprocess.Popen(
        [sys.executable, __file__, init_file], env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=0, world_size=2, timeout=_TIMEOUT
        )
        bucket, views = _make_views()

        def run(cmd: int) -> None:
            dist.broadcast(torch.tensor([cmd, _ITERS_PER_ROUND]), 0)
            _run(cmd, _ITERS_PER_ROUND, bucket, views)

        yield run
        dist.broadcast(torch.tensor([_STOP, 0]), 0)
        dist.destroy_process_group()
        helper.wait(timeout=60)
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()


_medians: dict[str, float] = {}


@pytest.mark.parametrize("mode", ["per_param", "flat"])
def test_allreduce_200_params(benchmark, pair: Callable[[int], None], mode: str) -> None:  # type: ignore[no-untyped-def]
    cmd = _FLAT if mode == "flat" else _PER_PARAM
    benchmark.extra_info["params"] = _NUM_PARAMS
    benchmark.extra_info["all_reduces_per_round"] = _ITERS_PER_ROUND
    benchmark.pedantic(pair, args=(cmd,), rounds=15, warmup_rounds=2)
    _medians[mode] = benchmark.stats.stats.median / _ITERS_PER_ROUND
    if len(_medians) == 2:
        ratio = _medians["per_param"] / _medians["flat"]
        benchmark.extra_info["per_param_over_flat"] = ratio
        print(
            f"\nGloo world 2, {_NUM_PARAMS} params: per-param all-reduce "
            f"{_medians['per_param'] * 1e3:.2f} ms, flat bucket {_medians['flat'] * 1e3:.2f} ms, "
            f"ratio {ratio:.1f}x"
        )


if __name__ == "__main__":
    _serve(sys.argv[1])
