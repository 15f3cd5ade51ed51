"""Where CUDA's caching allocator reserves memory it does not use, per system, on one GPU.

``bench_memory``'s ``test_bench_memory_cuda`` gives ``max_memory_reserved`` and the split bytes;
this script says where they sit. Each system of ``bench_memory`` (same model, batch and steps)
runs in fresh rank processes on GPU 0 (Gloo ranks sharing it, as the benchmark does with one
GPU) with ``torch.cuda.memory._record_memory_history`` on, and rank ``r`` writes
``<out>/<system>_r<r>.txt``:

- reserved, allocated and their peaks after every phase (bytes per param over the value before
  the system was built);
- every segment the allocator asked the driver for, in order, with the frames of the code that
  asked (shardkit, torch.optim / distributed / autograd and the benchmark; others elided);
- every segment after the last step with its blocks (state, size, the frames that allocated
  each active one): an ``inactive`` block in a segment with active ones is memory reserved and
  not usable for a larger request;
- the allocations of 1 MiB or more over the run, by size and site.

``torch.cuda.memory._record_memory_history`` and ``_snapshot`` are torch's documented memory
debugging API (https://pytorch.org/docs/stable/torch_cuda_memory.html), private names by
their spelling only. Needs a CUDA GPU; the systems' packages as ``bench_memory`` (fairscale
only for its row). Not collected by pytest. Run:
``python packages/ddp/benchmarks/cuda_segments.py --world 2 --systems shardkit_zero2,torch_zero
--out DIR``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_memory

_KEEP = ("shardkit", "bench_memory", "torch/distributed", "torch/optim", "torch/nn/parallel",
         "autograd", "fairscale")  # fmt: skip
"""Frames shown: the code that decides an allocation."""


def _frames(frames: list[dict[str, Any]]) -> str:
    picked = [
        f"{f['filename'].split('site-packages/')[-1].split('src/')[-1]}:{f['line']}:{f['name']}"
        for f in frames
        if any(k in f["filename"] for k in _KEEP)
    ]
    return " < ".join(picked[:5]) or "(no Python frame of interest)"


def _worker(rank: int, world: int, port: int, name: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    bench_memory._imports((name,))
    x = torch.randn(bench_memory._BATCH, bench_memory._WIDTH).to(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    base_reserved, base_allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    run, model, opt = bench_memory._build(name, device)
    bench_memory._released(name, device)
    n = sum(p.numel() for p in model.parameters())
    dtype = next(model.parameters()).dtype
    lines = [f"{name}, rank {rank}, world {world}, {n} params; bytes per param"]

    def note(tag: str) -> None:
        c = torch.cuda
        lines.append(
            f"{tag:>14}: reserved {(c.memory_reserved() - base_reserved) / n:.2f} "
            f"allocated {(c.memory_allocated() - base_allocated) / n:.2f} "
            f"peak reserved {(c.max_memory_reserved() - base_reserved) / n:.2f} "
            f"peak allocated {(c.max_memory_allocated() - base_allocated) / n:.2f}"
        )

    note("built")
    for step in range(bench_memory._STEPS):
        opt.zero_grad()
        loss = run(x.to(dtype)).float().square().mean()
        torch.cuda.synchronize()
        note(f"{step} forward")
        loss.backward()
        torch.cuda.synchronize()
        note(f"{step} backward")
        opt.step()
        if hasattr(run, "wait_params"):
            run.wait_params()
        torch.cuda.synchronize()
        note(f"{step} step")
        del loss
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    lines.append("== segments asked of the driver, in order (MiB) ==")
    for ev in trace:
        if ev["action"] in ("segment_alloc", "segment_free"):
            lines.append(f"{ev['action']} {ev['size'] / 2**20:8.2f}  {_frames(ev['frames'])}")
    lines.append("== segments after the last step (MiB) ==")
    for seg in snap["segments"]:
        lines.append(
            f"segment {seg['total_size'] / 2**20:8.2f}, allocated "
            f"{seg['allocated_size'] / 2**20:8.2f} ({seg.get('segment_type')} pool)"
        )
        for b in seg["blocks"]:
            where = _frames(b.get("frames", [])) if b["state"].startswith("active") else ""
            lines.append(f"    {b['state']:<20} {b['size'] / 2**20:8.2f}  {where}")
    sites: Counter[tuple[float, str]] = Counter()
    for ev in trace:
        if ev["action"] == "alloc" and ev["size"] >= 2**20:
            sites[(round(ev["size"] / 2**20, 2), _frames(ev["frames"]))] += 1
    lines.append("== allocations of 1 MiB or more over the run: count x MiB, site ==")
    for (size, site), count in sorted(sites.items(), key=lambda t: -t[0][0]):
        lines.append(f"{count:4d} x {size:8.2f}  {site}")
    with open(os.path.join(out, f"{name}_r{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--systems", default="shardkit_zero2,torch_zero")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_segments.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    for name in args.systems.split(","):
        if name not in bench_memory._ALL:
            raise SystemExit(f"unknown system {name!r}; bench_memory's: {bench_memory._ALL}")
        mp.spawn(
            _worker, args=(args.world, bench_memory._port(), name, args.out), nprocs=args.world
        )
        print(f"{name}: {args.out}/{name}_r*.txt", flush=True)


if __name__ == "__main__":
    main()
