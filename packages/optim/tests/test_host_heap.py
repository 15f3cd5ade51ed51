"""The engine hands the parameters' old blocks back once the flat buckets are laid out, on the
CPU through glibc's ``malloc_trim`` ([Note: The parameters' old blocks go back] in
``shardkit.optim._engine``; ``_host_heap.py``).

The allocator's state decides what a measure of resident memory shows, so each check runs in
a fresh process: what a user's job sees when it wraps a model it cast to bf16 first (the fp32
originals raise glibc's mmap threshold, so the bf16 blocks come from its heap).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from shardkit.optim import _host_heap

_glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="malloc_trim is glibc's: elsewhere the release is a logged no-op",
)

_CHILD = r"""
import json, os, sys
import torch

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

mode = sys.argv[1]
torch.set_num_threads(1)
if mode == "heap":
    from shardkit.optim._host_heap import release_host_heap

    torch.empty(4 << 20).fill_(1)  # freed: glibc's mmap threshold rises above 16 MiB
    hole = [torch.ones(2 << 20) for _ in range(8)]  # 8 MiB each, from the heap
    fence = torch.ones(1 << 20)  # above them: the hole is not the top of the heap
    del hole
    before = rss()
    released = release_host_heap()
    print(json.dumps({"released": released, "freed": before - rss()}))
else:
    import torch.distributed as dist
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer
    import shardkit.optim._engine as engine

    if mode == "kept":
        engine.release_host_heap = lambda: False
    dist.init_process_group(
        "gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    model = model.to(torch.bfloat16)  # the fp32 originals were mapped, the bf16 ones are not
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    before = rss()
    opt = ShardedOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-3, master_dtype=torch.float32
    )
    sdp = ShardedDataParallel(model, opt)
    print(json.dumps({"growth": rss() - before, "params": params}))
    dist.destroy_process_group()
"""


def _default_allocator() -> dict[str, str]:
    """This process's environment without glibc's tuning variables: the child runs glibc's
    defaults, which are what the checks are about (a fixed ``MALLOC_MMAP_THRESHOLD_`` would map
    the params' blocks, and ``munmap`` gives them back without any release)."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
    }


def _child(*args: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_default_allocator(), "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@_glibc
def test_release_host_heap_returns_the_free_pages_of_the_heap() -> None:
    """64 MiB freed below the top of glibc's heap stay resident until the release, which
    hands at least 48 MiB of them back."""
    got = _child("heap")
    assert got["released"] is True
    assert got["freed"] >= 48 << 20, got


@_glibc
def test_wrapping_a_cast_model_keeps_no_resident_copy_of_its_params(tmp_path: Path) -> None:
    """ShardedDataParallel over a model cast to bf16 (world 1): with the release, wrapping
    grows the resident set by at least half the params' bytes less than with it taken out:
    the params' old blocks, freed by the layout, are not resident any more."""
    default = _child("default", str(tmp_path / "a"))
    kept = _child("kept", str(tmp_path / "b"))
    assert kept["growth"] - default["growth"] >= default["params"] // 2, (default, kept)


def test_without_malloc_trim_the_release_is_a_no_op_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A C library without ``malloc_trim`` (musl, macOS's): nothing released, one log line."""

    class NoTrim:
        def __init__(self, name: object) -> None:
            pass

        def __getattr__(self, name: str) -> object:
            raise AttributeError(name)

    monkeypatch.setattr(ctypes, "CDLL", NoTrim)
    _host_heap._malloc_trim.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="shardkit.optim"):
            assert _host_heap.release_host_heap() is False
            assert _host_heap.release_host_heap() is False
    finally:
        _host_heap._malloc_trim.cache_clear()
    assert sum("no malloc_trim" in r.getMessage() for r in caplog.records) == 1
