"""ShardedDataParallel features: no_sync, clipping, bf16 + fp32 masters, Muon, state dicts,
byte counting, bad input. References are torch DDP + the plain optimizer at world 2, where the
reduction is order-independent (bit-for-bit unless the test states a tolerance)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _model(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16, bias=bias),
        nn.Tanh(),
        nn.Linear(16, 12, bias=bias),
        nn.Tanh(),
        nn.Linear(12, 3, bias=bias),
    )


def _batch(step: int, micro: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype)


def _loss(m: nn.Module, step: int, micro: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    x, y = _batch(step, micro, dtype)
    return nn.functional.mse_loss(m(x).float(), y.float())


def _equal(a: nn.Module, b: nn.Module) -> None:
    for (n, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), f"{n}: max diff {(x.float() - y.float()).abs().max().item()}"


@world(2)
def test_no_sync_accumulation_matches_ddp() -> None:
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)
    for step in range(3):
        for model, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            with model.no_sync():
                _loss(model, step, 0).backward()
            _loss(model, step, 1).backward()
            o.step()
    _equal(ref_m, m)
    assert all(p.grad is None for p in m.parameters())


@world(2)
def test_clip_grad_norm_matches_torch() -> None:
    """Norms are summed in another order (per bucket shard, then over ranks): rtol 1e-5."""
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.SGD(ref_m.parameters(), lr=0.5, momentum=0.9)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.5, momentum=0.9)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)
    for step in range(3):
        ref_opt.zero_grad()
        _loss(ref, step).backward()
        want = torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.05)
        ref_opt.step()
        opt.zero_grad()
        _loss(sdp, step).backward()
        got = opt.clip_grad_norm(0.05)
        opt.step()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        assert want > 0.05  # the clip is active
    for a, b in zip(ref_m.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@world(2)
def test_bf16_with_fp32_masters_matches_reference(name: str) -> None:
    """Reference: DDP on the bf16 model, fp32 copies stepped by the plain optimizer with the
    upcast averaged grads, cast back into the model: equal bit for bit."""
    cls, kw = {
        "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    }[name]
    ref_m = _model().to(torch.bfloat16)
    m = copy.deepcopy(ref_m)
    ref = DDP(ref_m)
    masters = [p.detach().float().clone() for p in ref_m.parameters()]
    ref_opt = cls(masters, **kw)
    opt = ShardedOptimizer(m.parameters(), optim=cls, master_dtype=torch.float32, **kw)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)
    for step in range(4):
        ref_m.zero_grad()
        _loss(ref, step, dtype=torch.bfloat16).backward()
        for mp, p in zip(masters, ref_m.parameters(), strict=True):
            mp.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for mp, p in zip(masters, ref_m.parameters(), strict=True):
                p.copy_(mp)
        opt.zero_grad()
        _loss(sdp, step, dtype=torch.bfloat16).backward()
        opt.step()
    _equal(ref_m, m)
    full = opt.state_dict(all_ranks=True)
    for i, mp in enumerate(masters):
        assert torch.equal(full["master_params"][i], mp)
    mem = sdp.memory_bytes()
    nparams = sum(p.numel() for p in m.parameters())
    assert mem["optimizer"] <= (12 * nparams) // 2 + 12 * 2 * 3  # fp32 master + 2 moments, 1/N


@world(2)
def test_muon_whole_params_bit_exact() -> None:
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    ref_m = _model(bias=False)
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.Muon(ref_m.parameters(), lr=0.02)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.Muon, lr=0.02)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)
    assert not any(b.elementwise for b in sdp._buckets)
    for step in range(3):
        for model, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
    _equal(ref_m, m)


@world(2)
def test_state_dict_round_trip_and_plain_format() -> None:
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.Adam(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.Adam, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)
    for step in range(2):
        for model, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
    opt.consolidate_state_dict()
    sd = opt.state_dict()
    want = ref_opt.state_dict()
    assert sorted(sd["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(sd["state"][i][k]), torch.as_tensor(v)), (i, k)
    # resume into a fresh wrapper from the saved weights + state: same continuation
    m2 = _model()
    m2.load_state_dict(m.state_dict())
    opt2 = ShardedOptimizer(m2.parameters(), optim=torch.optim.Adam, lr=1.0)
    sdp2 = ShardedDataParallel(m2, opt2, reduce_buffer_size=64)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-2
    for step in range(2, 4):
        for model, o in ((sdp, opt), (sdp2, opt2)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
    _equal(m, m2)


@world(2)
def test_bytes_match_ddp_ring_volume() -> None:
    """Ring model: reduce-scatter + all-gather of the padded buckets = DDP's all-reduce volume
    plus the padding (below N elements per bucket)."""
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64, broadcast_buffers=False)
    _loss(sdp, 0).backward()
    opt.step()
    stats = sdp.comm_stats
    n = dist.get_world_size()
    nparams = sum(p.numel() for p in m.parameters())
    ddp_bytes = 2 * (n - 1) / n * nparams * 4
    padded = sum(b.numel for b in sdp._buckets)
    assert padded - nparams < n * len(sdp._buckets)
    assert stats.bytes["reduce_scatter"] + stats.bytes["all_gather"] == 2 * (n - 1) / n * padded * 4
    assert stats.total_bytes() <= ddp_bytes * (1 + n * len(sdp._buckets) / nparams)
    assert stats.calls["reduce_scatter"] == stats.calls["all_gather"] == len(sdp._buckets)
    assert stats.calls["all_reduce"] == 1  # the requires_grad agreement: 4 bytes
    assert stats.buffer_bytes["all_reduce"] == 4
    assert sdp.memory_bytes()["grads"] == padded * 4 // n


@world(2)
def test_bad_input_raises() -> None:
    m = _model()
    with pytest.raises(TypeError, match="ShardedOptimizer"):
        ShardedDataParallel(m, torch.optim.SGD(m.parameters(), lr=0.1))  # type: ignore[arg-type]
    opt = ShardedOptimizer(list(m.parameters())[:2], optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="not in the optimizer"):
        ShardedDataParallel(m, opt)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="reduce_fp16"):
        ShardedDataParallel(m, opt, reduce_fp16=True)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ShardedDataParallel(m, opt, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="one ShardedOptimizer"):
        ShardedDataParallel(m, [opt, opt])


@world(2)
def test_rank_mismatch_in_bucket_plan_raises_everywhere() -> None:
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="plan different gradient buckets"):
        ShardedDataParallel(m, opt, reduce_buffer_size=64 * (1 + dist.get_rank()))


@world(2)
def test_overlap_param_gather_matches_ddp() -> None:
    """Gathers left in flight after step() are waited on by each layer's forward pre-hook."""
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.Adam(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.Adam, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64, overlap_param_gather=True)
    for step in range(3):
        for model, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
        if step == 0:
            assert len(sdp._gathers) == len(sdp._buckets)  # in flight until the next forward
    sd = m.state_dict()  # waits for the gathers still in flight
    assert not sdp._gathers
    for (n, a), b in zip(ref_m.named_parameters(), sd.values(), strict=True):
        assert torch.equal(a, b), n


@world(4, timeout=120)
def test_sub_process_groups() -> None:
    """Ranks {0, 1} and {2, 3} train independently, each against DDP on the same group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pg = groups[dist.get_rank() // 2]
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref = DDP(ref_m, process_group=pg)
    ref_opt = torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, group=pg, lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(m, opt, process_group=pg, reduce_buffer_size=64)
    for step in range(3):
        for model, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            _loss(model, step).backward()
            o.step()
    _equal(ref_m, m)


@pytest.mark.parametrize("kind", ["adamw-bf16-masters", "muon"])
@world(2)
def test_resume_from_state_dict_continues_bit_exact(kind: str) -> None:
    """Masters (element ranges) and whole-param state (Muon) survive a save/load exactly."""
    if kind == "muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    dtype = torch.bfloat16 if kind.startswith("adamw") else torch.float32
    cls = torch.optim.AdamW if kind.startswith("adamw") else torch.optim.Muon
    extra = {"master_dtype": torch.float32} if dtype == torch.bfloat16 else {}

    def build(m: nn.Module) -> tuple[ShardedDataParallel, ShardedOptimizer]:
        o = ShardedOptimizer(m.parameters(), optim=cls, lr=1e-2, **extra)
        return ShardedDataParallel(m, o, reduce_buffer_size=64), o

    m = _model(bias=kind != "muon").to(dtype)
    sdp, opt = build(m)
    for step in range(2):
        opt.zero_grad()
        _loss(sdp, step, dtype=dtype).backward()
        opt.step()
    sd = opt.state_dict(all_ranks=True)
    m2 = _model(bias=kind != "muon").to(dtype)
    m2.load_state_dict(m.state_dict())
    sdp2, opt2 = build(m2)
    opt2.load_state_dict(sd)
    for step in range(2, 4):
        for model, o in ((sdp, opt), (sdp2, opt2)):
            o.zero_grad()
            _loss(model, step, dtype=dtype).backward()
            o.step()
    _equal(m, m2)


@world(2)
def test_manual_reduce_after_no_sync_matches_ddp() -> None:
    """fairscale's manual reduction: every backward under no_sync(), then reduce()."""
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)
    for step in range(2):
        ref_opt.zero_grad()
        with ref.no_sync():
            _loss(ref, step, 0).backward()
        _loss(ref, step, 1).backward()
        ref_opt.step()
        opt.zero_grad()
        with sdp.no_sync():
            _loss(sdp, step, 0).backward()
            _loss(sdp, step, 1).backward()
        sdp.reduce()
        opt.step()
    _equal(ref_m, m)
