"""CUDA tensors: NCCL at any world size the GPUs allow, and Gloo ranks sharing one GPU.

Skipped with the reason where no GPU is visible (NCCL at world 2 also needs two GPUs). Every
variant runs the same body: Adam steps under ShardedGradScaler against plain Adam on the same
full batch, consolidation onto the last rank (point-to-point traffic, staged through host
memory over Gloo), clipping, and a DCP save/load round trip of CUDA state.

Tolerance: ``assert_close`` defaults (fp32: rtol 1.3e-6, atol 1e-5). Scaling by a power of two
is exact, but the sharded run steps each rank's params with the foreach kernels over its own
subset while the reference steps all of them at once, and CUDA kernels may group differently.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import (
    ShardedGradScaler,
    ShardedOptimizer,
    build_flat_buckets,
    load_sharded,
    save_sharded,
)
from shardkit.testing import rank_cuda_device, world
from torch import nn


def _body(tmp: Path) -> None:
    device = rank_cuda_device()
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    model = copy.deepcopy(ref_model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    scaler = ShardedGradScaler("cuda", group=opt.group)
    for s in range(3):
        g = torch.Generator(device=device).manual_seed(s)
        x = torch.randn(6, 4, device=device, generator=g)  # the same full batch on every rank
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            if o is opt:
                scaler.scale(m(x).square().mean()).backward()
                scaler.step(o)
                scaler.update()
            else:
                m(x).square().mean().backward()
                o.step()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert b.device == device
        torch.testing.assert_close(a, b)
    recipient = size - 1
    opt.consolidate_state_dict(recipient_rank=recipient)
    if rank == recipient:
        sd = opt.state_dict()
        for i, st in ref.state_dict()["state"].items():
            assert sd["state"][i]["exp_avg"].device.type == "cpu"
            torch.testing.assert_close(sd["state"][i]["exp_avg"], st["exp_avg"].cpu())
            torch.testing.assert_close(sd["state"][i]["exp_avg_sq"], st["exp_avg_sq"].cpu())
    norm = opt.clip_grad_norm(1.0)
    assert norm.device == device
    # DCP round trip of CUDA state into a fresh optimizer over the same params
    save_sharded(opt, tmp / "ckpt")
    fresh = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    load_sharded(fresh, tmp / "ckpt")
    for p in fresh.owned_params:
        for key, value in opt.optim.state[p].items():
            got = fresh.optim.state[p][key]
            if isinstance(value, torch.Tensor):
                assert got.device == value.device, key
                assert torch.equal(got, value), key
            else:
                assert got == value, key


@pytest.mark.nccl
@world(2, backend="nccl")
def test_nccl_world2(tmp_path: Path) -> None:
    _body(tmp_path)


@pytest.mark.nccl
@world(1, backend="nccl")
def test_nccl_world1(tmp_path: Path) -> None:
    _body(tmp_path)


@pytest.mark.cuda
@world(2)
def test_gloo_ranks_sharing_a_gpu(tmp_path: Path) -> None:
    _body(tmp_path)


@pytest.mark.cuda
@world(3)
def test_gloo_three_ranks_sharing_a_gpu(tmp_path: Path) -> None:
    _body(tmp_path)


def _master_body(tmp_path: Path) -> None:
    """bf16 CUDA model with fp32 masters against the plain optimizer on fp32 copies; the model
    params are always the masters rounded; a DCP round trip restores the masters exactly."""
    device = rank_cuda_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)).to(device, torch.bfloat16)
    ref_model = copy.deepcopy(model)
    masters = [p.detach().float().clone() for p in ref_model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2)
    kw = {"lr": 1e-2, "master_dtype": torch.float32, "master_grad_bucket_bytes": 512}
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    scaler = ShardedGradScaler("cuda", init_scale=2.0**8, group=opt.group)
    for s in range(3):
        g = torch.Generator(device=device).manual_seed(s)
        x = torch.randn(16, 8, device=device, generator=g).bfloat16()
        for m in (ref_model, model):
            m.zero_grad()
        ref_model(x).float().square().mean().backward()
        scaler.scale(model(x).float().square().mean()).backward()
        for p, mm in zip(ref_model.parameters(), masters, strict=True):
            assert p.grad is not None
            mm.grad = p.grad.float()
        ref.step()
        with torch.no_grad():
            for p, mm in zip(ref_model.parameters(), masters, strict=True):
                p.copy_(mm)
        scaler.step(opt)
        scaler.update()
    full = opt.master_model_state_dict(model, recipient_rank=-1)
    assert full is not None
    for (name, p), mm in zip(model.named_parameters(), masters, strict=True):
        torch.testing.assert_close(full[name], mm.cpu())
        assert torch.equal(p, full[name].to(device, torch.bfloat16)), name
    save_sharded(opt, tmp_path / "masters")
    fresh = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    load_sharded(fresh, tmp_path / "masters")
    again = fresh.master_model_state_dict(model, recipient_rank=-1)
    assert again is not None
    for name, value in full.items():
        assert torch.equal(again[name], value), name


@pytest.mark.nccl
@world(1, backend="nccl")
def test_master_weights_nccl_world1(tmp_path: Path) -> None:
    _master_body(tmp_path)


@pytest.mark.cuda
@world(2)
def test_master_weights_gloo_ranks_sharing_a_gpu(tmp_path: Path) -> None:
    _master_body(tmp_path)


@pytest.mark.cuda
def test_flat_buffers_round_once_on_cuda() -> None:
    """[Note: Flat buffers in one allocation]: four buckets of a 2048 x 2048 weight and its bias
    (16.01 MiB each) grow the reserved memory by their bytes rounded up once (66 MiB), not once
    per bucket (4 x 18 MiB), and the params keep their values."""
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [
        nn.Parameter(torch.randn(s, device="cuda", generator=g))
        for _ in range(4)
        for s in ((2048, 2048), (2048,))
    ]
    values = [p.detach().clone() for p in params]
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    cap = 16 << 20
    buckets, _ = build_flat_buckets(
        [{"params": params}], [True], 2, cap_bytes=cap, first_cap_bytes=cap
    )
    grown = torch.cuda.memory_reserved() - before
    flats = sum(b.numel * b.flat.element_size() for b in buckets)
    assert len(buckets) == 4 and flats > 4 * (16 << 20)
    assert grown <= flats + (2 << 20), (grown, flats)
    for p, v in zip(params, values, strict=True):
        assert torch.equal(p, v)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_compact_codec_on_cuda_gives_the_cpu_bytes(kind: str) -> None:
    """The compact moments' codec is exact arithmetic (block extremes, one division, integer
    ops, a table lookup; ``map[code] * scale`` back), so a moment quantized on the GPU has the
    codes and scale bits of the same moment quantized on the CPU, and dequantizes to the same
    bits: blocks of random values over many magnitudes, a block cut short, a negative extreme,
    zeros, subnormals and a non-finite block ([Note: Non-finite and tiny blocks] in
    ``shardkit.optim._compact``)."""
    from shardkit.optim._compact import CompactTensor, moment_formats

    g = torch.Generator().manual_seed(0)
    for fmt in moment_formats(kind):
        n = 5 * fmt.block + 7
        x = torch.randn(n, generator=g) * torch.logspace(-30, 3, n).float()
        if not fmt.qmap.signed:
            x = x.abs()
        x[: fmt.block] = 0.0
        x[fmt.block : fmt.block + 3] = (
            torch.tensor([1e-40, -3e-42, 2e-39]).abs().mul(1.0 if not fmt.qmap.signed else -1.0)
        )
        x[2 * fmt.block + 1] = float("inf")
        x[3 * fmt.block + 4] = -x[3 * fmt.block : 4 * fmt.block].abs().max() * 2
        on_cpu = CompactTensor.from_tensor(x, fmt)
        on_gpu = CompactTensor.from_tensor(x.cuda(), fmt)
        assert torch.equal(on_gpu.codes.cpu(), on_cpu.codes), fmt
        assert torch.equal(on_gpu.scales.cpu().view(torch.int32), on_cpu.scales.view(torch.int32))
        back_cpu, back_gpu = on_cpu.dequantize(), on_gpu.dequantize().cpu()
        assert torch.equal(back_gpu.view(torch.int32), back_cpu.view(torch.int32)), fmt


@pytest.mark.cuda
@pytest.mark.parametrize(("kind", "amsgrad"), [("int8", False), ("int4", True)])
@pytest.mark.parametrize("decay", ["adam", "adamw"])
def test_compact_kernel_on_cuda_within_tolerance(kind: str, amsgrad: bool, decay: str) -> None:
    """The compiled compact step on CUDA is one Triton kernel per chunk ([Note: One kernel on a
    GPU] in ``shardkit.optim._compact_kernel``): from the same state, one step each, within the
    tolerance of ``tests/test_compact_kernel.py`` of the eager CUDA step, over three steps with
    a padded last chunk, maximize, and a new learning rate that does not recompile."""
    from _compact_testkit import assert_close_step
    from shardkit.optim import _compact_fused, _compact_kernel
    from shardkit.optim._compact import CompactTensor
    from shardkit.optim._compact_step import AdamState, compact_adam_step

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 2 * _compact_fused.FUSED_CHUNK + 1000
    p = torch.randn(n, device="cuda", generator=g)
    ours = AdamState.zeros(p, kind, amsgrad=amsgrad, fused=True)
    ref = AdamState.zeros(p, kind, amsgrad=amsgrad, fused=True)
    kw: dict[str, Any] = dict(
        betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, amsgrad=amsgrad,
        decoupled_weight_decay=decay == "adamw", impl="fused",
    )  # fmt: skip
    for step, lr in enumerate((1e-3, 1e-3, 3e-4)):
        grad = torch.randn(n, device="cuda", generator=g) * 1e-2
        for (_, a), (_, b) in zip(ours.moments(), ref.moments(), strict=True):
            assert isinstance(a, CompactTensor) and isinstance(b, CompactTensor)
            b.codes.copy_(a.codes)
            b.scales.copy_(a.scales)
        ref.step.copy_(ours.step)
        pe, pk = p.clone(), p.clone()
        compact_adam_step([pe], [grad], [ref], lr=lr, maximize=step == 1, compiled=False, **kw)
        misses = _compact_kernel._compiled.cache_info().misses
        stance = "fail_on_recompile" if step == 2 else "default"
        with torch.compiler.set_stance(stance):
            compact_adam_step([pk], [grad], [ours], lr=lr, maximize=step == 1, compiled=True, **kw)
        assert _compact_fused.compiled_unavailable() is None
        if step == 2:
            assert _compact_kernel._compiled.cache_info().misses == misses
        assert_close_step((pe, ref), (pk, ours), p, lr)
        p = pk
