"""Memory per rank as a user sees it: peak and steady resident memory beside the live tensors.

Issue 37's measurement (issue 25's live count kept beside it). Model: 8 x Linear(2048) (33.6M
params; ``SHARDKIT_BENCH_MEM_WIDTH`` / ``SHARDKIT_BENCH_MEM_LAYERS`` shrink it), batch 32,
AdamW ``fused=True`` on every side, Gloo on CPU, world 2 and 4. **Each system runs alone in
fresh rank processes** (one ``torch.multiprocessing.spawn`` per system, world and repeat), so
the pages one system freed cannot lower or raise another's figures, and at **default allocator
settings** (no ``MALLOC_*`` variable; the two ``*_mmap_threshold`` rows set one on purpose,
see below). Per rank, every figure is the growth over the rank's resident set just before the
system was built (after the process group, the imports and the batch), in bytes per param:

- ``peak``: the peak resident set (``VmHWM``) over the training steps, reset before every
  phase (``/proc/self/clear_refs``, ``shardkit.testing.reset_peak_memory``) so the peak *during*
  each phase is read: ``peak_forward`` (``zero_grad`` and the forward, which waits for the
  previous step's param gathers), ``peak_backward`` (backward and its reductions),
  ``peak_step`` (``optimizer.step()``, the param gathers waited for); ``peak`` is the largest;
- ``steady``: the resident set after the last step; ``build``: the peak while building it;
- ``live``: every live tensor storage after the last step, counted once
  (``shardkit.testing.live_storages``, plus each param's ``.grad``);
- ``heap_in_use`` / ``heap_free``: bytes glibc has handed out / holds free in its arenas
  (``mallinfo2``, read through ctypes here only), and ``rss_file``: the growth of file-backed
  resident pages (library code run for the first time): what separates ``steady`` from
  ``live``;
- with a CUDA device (``test_bench_memory_cuda``, skipped on CPU): ``cuda_peak_allocated`` and
  ``cuda_peak_reserved`` (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, reset
  per phase) instead of the resident figures.

Ranks differ in the last digit (the allocator's layout): each figure is the largest over the
ranks, and over ``SHARDKIT_BENCH_MEM_REPEATS`` (default 2) fresh runs, with the smallest run
beside it (``*_low``). ``SHARDKIT_BENCH_MEM_STEPS`` (default 5) steps per run.

Systems: ``ddp`` (torch DDP, ``gradient_as_bucket_view=True``, its best configuration: the
gradients are its buckets) and ``ddp_default`` (without it: ``.grad`` and the buckets, which
live in C++ where the live count cannot see them), ``torch_zero`` (DDP with bucket views + torch
``ZeroRedundancyOptimizer``), ``fairscale`` (``OSS`` + fairscale ``ShardedDataParallel``),
``shardkit_zero1`` (DDP with bucket views + ``ShardedOptimizer``), ``shardkit_zero1_overlap``
(the same stepped by ``register_zero_overlap``), ``shardkit_zero2`` (``ShardedDataParallel``,
default arguments), ``shardkit_zero2_bf16`` (bf16 params, fp32 masters), and one row per
option of it: ``_free_staging`` (``keep_staging_buffers=False``), ``_views``
(``gradient_as_bucket_view=True``), ``_sync_gather`` (``overlap_param_gather=False``),
``_reduce_bf16`` (``reduce_dtype=torch.bfloat16``), ``_int8`` / ``_int4`` (``wire="int8"`` /
``"int4"``: quantized collectives, fp32 masters of the owned shard). The ``ddp_mmap_threshold`` and
``shardkit_zero2_mmap_threshold`` rows run with ``MALLOC_MMAP_THRESHOLD_=131072`` (every block
of 128 KiB or more mapped afresh and unmapped when freed, so resident memory follows the live
tensors): what the same programs hold when the allocator keeps nothing freed. On CUDA only, the
``*_expandable_segments`` rows set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` and
``shardkit_zero2_release_cache`` calls ``torch.cuda.empty_cache()`` once the system is built
(the model's own parameter blocks, freed when the params moved into the flat buckets, go back to
the driver): what those cached blocks add to the reserved peak (since shardkit-optim 0.11.1
the engine releases them itself, so the row should match ``shardkit_zero2``).

Run: ``python -m pytest -o python_files='bench_*.py' packages/ddp/benchmarks/bench_memory.py
-q -s`` (about 20 minutes on 2 cores; ``SHARDKIT_BENCH_MEM_ONLY=a,b`` runs those systems only).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import socket
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from shardkit.testing import live_storages, memory_sample, reset_peak_memory
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

_WIDTH = int(os.environ.get("SHARDKIT_BENCH_MEM_WIDTH", "2048"))
_LAYERS = int(os.environ.get("SHARDKIT_BENCH_MEM_LAYERS", "8"))
_STEPS = int(os.environ.get("SHARDKIT_BENCH_MEM_STEPS", "5"))
_REPEATS = int(os.environ.get("SHARDKIT_BENCH_MEM_REPEATS", "2"))
_BATCH = 32
_MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
_EXPANDABLE_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
_ALL = (
    "ddp",
    "ddp_default",
    "torch_zero",
    "fairscale",
    "shardkit_zero1",
    "shardkit_zero1_overlap",
    "shardkit_zero2",
    "shardkit_zero2_bf16",
    "shardkit_zero2_free_staging",
    "shardkit_zero2_views",
    "shardkit_zero2_sync_gather",
    "shardkit_zero2_reduce_bf16",
    "shardkit_zero2_int8",
    "shardkit_zero2_int4",
    "ddp_mmap_threshold",
    "shardkit_zero2_mmap_threshold",
    "torch_zero_expandable_segments",
    "shardkit_zero2_expandable_segments",
    "shardkit_zero2_release_cache",
)
_ONLY = [s for s in os.environ.get("SHARDKIT_BENCH_MEM_ONLY", "").split(",") if s]
_SYSTEMS = tuple(s for s in _ALL if not _ONLY or s in _ONLY)
_PHASES = ("forward", "backward", "step")
_TARGETS = {"shardkit_zero2": 12.5, "shardkit_zero2_bf16": 11.0}
"""Issue 37's targets for the peak at world 2 (bytes per param)."""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _heap() -> tuple[int, int]:
    """(bytes glibc handed out, bytes it holds free): ``mallinfo2``, 0s where absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return 0, 0
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


def _imports(systems: tuple[str, ...] = _SYSTEMS) -> None:
    """Everything the systems need, imported before the baseline is read (fairscale only when
    its row runs: a GPU machine may not have it)."""
    modules = ["shardkit.ddp", "shardkit.optim", "shardkit.overlap", "torch.distributed.optim"]
    if "fairscale" in systems:
        modules += ["fairscale.nn.data_parallel", "fairscale.optim"]
    for module in modules:
        importlib.import_module(module)


def _build(name: str, device: torch.device) -> tuple[nn.Module, nn.Module, Any]:
    """(module to run, the model, optimizer) of system ``name``."""
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer

    name = name.removesuffix("_mmap_threshold").removesuffix("_expandable_segments")
    name = name.removesuffix("_release_cache")
    bf16 = name == "shardkit_zero2_bf16"
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(_WIDTH, _WIDTH) for _ in range(_LAYERS)])
    model = model.to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    adamw: dict[str, Any] = {"lr": 1e-4, "fused": True}
    if name in ("ddp", "ddp_default"):
        run = DDP(model, gradient_as_bucket_view=name == "ddp")
        return run, model, torch.optim.AdamW(model.parameters(), **adamw)
    if name == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, **adamw
        )
        return DDP(model, gradient_as_bucket_view=True), model, opt
    if name == "fairscale":
        from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
        from fairscale.optim import OSS

        oss = OSS(model.parameters(), optim=torch.optim.AdamW, **adamw)
        return FairscaleSDP(model, oss), model, oss
    if name.startswith("shardkit_zero1"):
        from shardkit.overlap import register_zero_overlap

        run = DDP(model, gradient_as_bucket_view=True)
        zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **adamw)
        if name.endswith("overlap"):
            register_zero_overlap(run, zero)
        return run, model, zero
    opt = ShardedOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        master_dtype=torch.float32 if bf16 else None,
        **adamw,
    )
    sdp = ShardedDataParallel(
        model,
        opt,
        broadcast_buffers=False,
        keep_staging_buffers=not name.endswith("free_staging"),
        gradient_as_bucket_view=name.endswith("views"),
        overlap_param_gather=not name.endswith("sync_gather"),
        reduce_dtype=torch.bfloat16 if name.endswith("reduce_bf16") else None,
        wire=name.removeprefix("shardkit_zero2_") if name.endswith(("int8", "int4")) else "exact",
    )
    return sdp, model, opt


def _released(name: str, device: torch.device) -> None:
    """``*_release_cache`` rows: the blocks freed while building (the model's own parameter
    storage, moved into the flat buckets) handed back to the driver before the steps, to
    measure what they add to the reserved peak (the ddp README's CUDA section)."""
    if name.endswith("_release_cache") and device.type == "cuda":
        torch.cuda.empty_cache()


def _measure(name: str, rank: int, device: torch.device) -> dict[str, float]:
    """One system on this rank: growth over the baseline, bytes per param."""
    cuda = device if device.type == "cuda" else None
    x = torch.randn(_BATCH, _WIDTH, generator=torch.Generator().manual_seed(rank)).to(device)
    gc.collect()
    before = set(live_storages())
    base, (heap_base, free_base) = memory_sample(cuda), _heap()
    reset_peak_memory(cuda)
    run, model, opt = _build(name, device)
    _released(name, device)
    built = memory_sample(cuda)
    n = sum(p.numel() for p in model.parameters())
    dtype = next(model.parameters()).dtype
    peaks: dict[str, float] = dict.fromkeys(_PHASES, 0.0)
    key = "peak_rss" if cuda is None else "cuda_peak_reserved"
    ref = getattr(base, "rss" if cuda is None else "cuda_reserved") or 0
    out: dict[str, float] = {"build": (getattr(built, key) - ref) / n}
    if cuda is not None:
        out["cuda_peak_allocated"] = 0.0
        out.update({f"cuda_peak_allocated_{p}": 0.0 for p in _PHASES})
    for _ in range(_STEPS):
        for phase in _PHASES:
            reset_peak_memory(cuda)
            if phase == "forward":
                opt.zero_grad()
                loss = run(x.to(dtype)).float().square().mean()
            elif phase == "backward":
                loss.backward()
            else:
                opt.step()
                if hasattr(run, "wait_params"):
                    run.wait_params()
            s = memory_sample(cuda)
            peaks[phase] = max(peaks[phase], (getattr(s, key) - ref) / n)
            if cuda is not None and s.cuda_peak_allocated is not None:
                grown = (s.cuda_peak_allocated - (base.cuda_allocated or 0)) / n
                out["cuda_peak_allocated"] = max(out["cuda_peak_allocated"], grown)
                key_p = f"cuda_peak_allocated_{phase}"
                out[key_p] = max(out[key_p], grown)
        del loss
    after = memory_sample(cuda)
    heap, free = _heap()
    params = list(model.parameters())
    live = live_storages([p.grad for p in params])
    out.update({f"peak_{p}": v for p, v in peaks.items()})
    out["peak"] = max(peaks.values())
    out["steady"] = ((after.rss - base.rss) if cuda is None else after.cuda_reserved - ref) / n
    out["live"] = sum(v for k, v in live.items() if k not in before) / n
    out["heap_in_use"] = (heap - heap_base) / n
    out["heap_free"] = (free - free_base) / n
    out["rss_file"] = (after.rss_file - base.rss_file) / n
    if cuda is not None:
        # cached blocks that are split and partly free: the caching allocator's fragmentation
        stats = torch.cuda.memory_stats(cuda)
        out["cuda_inactive_split"] = stats.get("inactive_split_bytes.all.current", 0) / n
        grown_steady = (after.cuda_allocated or 0) - (base.cuda_allocated or 0)
        out["cuda_allocated_steady"] = grown_steady / n
    out["params"] = float(n)
    return out


def _worker(rank: int, world: int, port: int, name: str, device: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    nccl = dev.type == "cuda" and torch.cuda.device_count() >= world
    dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world)
    try:
        _imports()
        result = _measure(name, rank, dev)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(name: str, world: int, device: str) -> list[dict[str, float]]:
    """Every rank's figures for one fresh run of ``name``."""
    env = _MMAP_ENV if name.endswith("_mmap_threshold") else {}
    if name.endswith("_expandable_segments"):
        env = _EXPANDABLE_ENV
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read by glibc when the spawned ranks start
    try:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            mp.spawn(_worker, args=(world, _port(), name, device, out), nprocs=world, join=True)
            with open(out) as f:
                return list(json.load(f))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _summary(runs: list[list[dict[str, float]]]) -> dict[str, float]:
    """Largest over ranks per run; then the largest run, and the smallest run as ``*_low``."""
    per_run = [{k: max(r[k] for r in ranks) for k in ranks[0]} for ranks in runs]
    out = {k: max(r[k] for r in per_run) for k in per_run[0]}
    for k in ("peak", "steady"):
        if k in out:
            out[f"{k}_low"] = min(r[k] for r in per_run)
    out["runs"] = float(len(runs))
    return out


def _bench(benchmark: Any, world: int, device: str) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}

    def run_all() -> None:
        for name in _SYSTEMS:
            if name.endswith(("_expandable_segments", "_release_cache")) and device != "cuda":
                continue  # a CUDA caching-allocator setting or call
            results[name] = _summary([_run(name, world, device) for _ in range(_REPEATS)])
            print(name, json.dumps({k: round(v, 2) for k, v in results[name].items()}), flush=True)

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    info = benchmark.extra_info
    for ours in ("shardkit_zero2", "shardkit_zero2_bf16"):
        for ref in ("torch_zero", "fairscale", "ddp"):
            if ours in results and ref in results:
                info[f"{ours}_peak_vs_{ref}"] = results[ours]["peak"] / results[ref]["peak"]
    if world == 2 and device == "cpu":
        for ours, target in _TARGETS.items():
            info[f"target_peak_{ours}"] = target
    info["model"] = (
        f"{_LAYERS} x Linear({_WIDTH}), AdamW fused, batch {_BATCH}, world {world}, "
        f"{_STEPS} steps, {_REPEATS} fresh runs per system, bytes per param, max over ranks"
    )
    info["results"] = results
    info["run"] = (
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_bench_memory(benchmark: Any, world: int) -> None:
    _bench(benchmark, world, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("world", [2, 4])
def test_bench_memory_cuda(benchmark: Any, world: int) -> None:
    """CUDA: ``max_memory_allocated`` / ``max_memory_reserved`` per phase (NCCL with a GPU per
    rank, else Gloo ranks sharing the GPUs), world 2 and 4."""
    _bench(benchmark, world, "cuda")
