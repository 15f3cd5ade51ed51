"""No per-step allocation churn (issue 37): after the first steps, a training step of
ShardedDataParallel allocates no large tensor of its own.

Counted with ``shardkit.testing.LargeAllocations``: every new tensor storage of at least 64 KiB
that shardkit code asks for, on the rank's thread, in forward (pre-hooks, buffer broadcast),
backward (the gradient hooks, the end-of-backward flush), clipping and the step. Not counted, by
construction ([Note: Counting our allocations] in ``shardkit.testing._allocations``): the
gradient the autograd kernel allocates for each param and the model's activations (not ours to
remove), and what a collective allocates inside its own implementation, on Gloo's worker
threads: that is what ``test_steady_steps_allocate_nothing_large_in_any_thread`` counts, with
torch's profiler (its memory events see every tensor allocation of every thread a collective
runs on: plain Gloo's ``reduce_scatter`` shows its chunk clones there, its ``all_gather`` its
receive buffers). On Gloo the package's reduce-scatter is point to point into buffers of its
own, allocated with the layout, and its all-gather one broadcast per rank ([Note: Gloo
collectives] in ``shardkit.optim._wire``); NCCL allocates nothing either.

64 KiB: half of glibc's initial mmap threshold (blocks below it are recycled in the allocator's
bins), and a quarter of the smallest per-bucket buffer of this model (a bf16 grad shard, 256
KiB), so a staging buffer, a reduce temporary or a bucket's upcast gradients would all show; the
per-step tensors that stay are a byte per param (the usage mask) and scalars (norms, flags).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import LargeAllocations, world
from torch import nn
from torch.profiler import ProfilerActivity, profile

WIDTH = 512
LAYERS = 4
STEPS = 5
STEADY = 1  # every step after the first, which allocates the optimizer state

_VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16_masters": {"bf16": True},
    "reduce_fp16": {"ddp": {"reduce_dtype": torch.float16}},
    "no_sync_accumulation": {"no_sync": 2},
    "two_synced_backwards": {"backwards": 2},
    "bucket_views": {"ddp": {"gradient_as_bucket_view": True}},
    "sync_gather": {"ddp": {"overlap_param_gather": False}},
    "clip": {"clip": True},
    "clip_bf16_masters": {"clip": True, "bf16": True},
    "wire_int8": {"ddp": {"wire": "int8"}},
    "wire_int4_bf16_masters": {"ddp": {"wire": "int4"}, "bf16": True},
    "wire_int8_accumulation": {"ddp": {"wire": "int8"}, "no_sync": 2, "clip": True},
}


def _system(
    bf16: bool, ddp: dict[str, Any] | None
) -> tuple[ShardedOptimizer, ShardedDataParallel, torch.dtype]:
    """The tests' model under ShardedDataParallel + AdamW (fused), a bucket per layer or more."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(dtype)
    opt = ShardedOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=1e-3,
        fused=True,
        master_dtype=torch.float32 if bf16 else None,
    )
    sdp = ShardedDataParallel(model, opt, bucket_cap_mb=1.0, first_bucket_cap_mb=1.0, **(ddp or {}))
    assert len(sdp._buckets) >= LAYERS, [b.numel for b in sdp._buckets]
    return opt, sdp, dtype


def _steps(bf16: bool = False, no_sync: int = 0, backwards: int = 1, clip: bool = False,
           ddp: dict[str, Any] | None = None) -> list[LargeAllocations]:  # fmt: skip
    opt, sdp, dtype = _system(bf16, ddp)
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randn(8, WIDTH, generator=g).to(dtype) for _ in range(no_sync + backwards)]
    counts = []
    for _ in range(STEPS):
        with LargeAllocations() as allocs:
            opt.zero_grad()
            for x in batches[:no_sync]:
                with sdp.no_sync():
                    sdp(x).float().square().mean().backward()
            for x in batches[no_sync:]:
                sdp(x).float().square().mean().backward()
            if clip:
                sdp.clip_grad_norm_(1.0)
            opt.step()
        counts.append(allocs)
    sdp.wait_params()
    return counts


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
@world(2, timeout=180)
def test_steady_steps_allocate_nothing_large(variant: str) -> None:
    counts = _steps(**_VARIANTS[variant])
    # the first step allocates the optimizer state (AdamW's moments): the counter sees it
    assert any("shard_stepper" in r.where for r in counts[0].records), counts[0].records
    for step, allocs in enumerate(counts[STEADY:], start=STEADY + 1):
        assert allocs.records == [], (variant, step, allocs.records)


@world(2, timeout=120)
def test_freeing_the_pool_allocates_it_every_step() -> None:
    """keep_staging_buffers=False (the pool freed after each step): every backward allocates
    the staging buffers again, from the one pool ([Note: Wire buffers] in
    shardkit.optim._wire), and the counter sees them. At world 2 on Gloo the reduce-scatter
    needs no receive buffer: the peer's chunk lands in the grad shard ([Note: Gloo
    reduce-scatter point to point])."""
    counts = _steps(ddp={"keep_staging_buffers": False})
    for allocs in counts[STEADY:]:
        assert all("shardkit.optim._wire" in r.where for r in allocs.records), allocs.records
        staged = [r for r in allocs.records if r.nbytes >= WIDTH * WIDTH * 4]
        assert len(staged) == 2, allocs.records
        assert len(allocs.records) == 2, allocs.records


_PROFILED = ["fp32", "bf16_masters", "reduce_fp16", "two_synced_backwards", "clip", "wire_int8"]


def _model_kernel(event: Any) -> bool:
    """Whether a profiler event runs inside one of the model's backward functions (autograd's
    gradient of a param and the kernel's own temporaries: not ours, and not a collective's).
    The package's gradient hooks run under the ``AccumulateGrad`` nodes instead."""
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function: ") and event.name.endswith(
            "Backward0"
        ):
            return True
        event = event.cpu_parent
    return False


@pytest.mark.parametrize("variant", _PROFILED)
@world(2, timeout=180)
def test_steady_steps_allocate_nothing_large_in_any_thread(variant: str) -> None:
    """Steady steps allocate no tensor of 64 KiB or more on any thread, the collectives' worker
    threads included, but autograd's own gradients (issue 49). Counted by torch's profiler
    (``profile_memory=True``), whose memory events follow the collectives onto Gloo's threads;
    under a profiler the step waits for its gathers on Gloo ([Note: Gloo gathers and the
    profiler] in shardkit-optim), so they land inside the profiled steps too."""
    _profiled_steps(variant)


@world(4, timeout=240)
def test_steady_steps_allocate_nothing_large_in_any_thread_world4() -> None:
    """The same at world 4, where Gloo's point-to-point reduce-scatter receives into the
    pool's buffers ([Note: Gloo reduce-scatter point to point] in shardkit-optim)."""
    _profiled_steps("fp32")


def _profiled_steps(variant: str) -> None:
    options = _VARIANTS[variant]
    opt, sdp, dtype = _system(bool(options.get("bf16")), options.get("ddp"))
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(8, WIDTH, generator=g).to(dtype)

    def step() -> None:
        opt.zero_grad()
        for _ in range(options.get("backwards", 1)):
            sdp(x).float().square().mean().backward()
        if options.get("clip"):
            sdp.clip_grad_norm_(1.0)
        opt.step()

    for _ in range(3):
        step()
    sdp.wait_params()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(2):
            step()
        sdp.wait_params()
    large = [e for e in prof.events() if e.self_cpu_memory_usage >= 64 << 10]
    grads = [e for e in large if _model_kernel(e)]
    others = [(e.name, e.self_cpu_memory_usage, e.thread) for e in large if not _model_kernel(e)]
    assert others == [], (variant, others)
    # the counter works: autograd's gradient of each weight, every backward
    per_step = LAYERS * options.get("backwards", 1)
    assert len(grads) >= 2 * per_step, [(e.name, e.self_cpu_memory_usage) for e in large]
    dist.barrier()


@world(2, timeout=120)
def test_the_profiler_sees_allocations_inside_gloo_collectives() -> None:
    """The counter of the test above sees what a Gloo collective allocates on its worker
    thread: plain ``reduce_scatter`` clones the chunks this rank does not own."""
    x = torch.randn(WIDTH * WIDTH)
    out = torch.empty(WIDTH * WIDTH // 2)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        dist.reduce_scatter(out, list(x.chunk(2)))
    large = [e for e in prof.events() if e.self_cpu_memory_usage >= 64 << 10]
    assert any(not _model_kernel(e) for e in large), [(e.name, e.thread) for e in large]
