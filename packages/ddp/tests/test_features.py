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
    got = b.state_dict()  # waits for the param gathers still in flight (overlap_param_gather)
    for n, x in a.named_parameters():
        y = got[n]
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
    # no full-size gradient is left: .grad holds the memory-less reduced-grad placeholders
    assert all("reduce-scattered" in repr(p.grad) for p in m.parameters())


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
    for a, b in zip(ref_m.parameters(), sdp.parameters(), strict=True):  # waits for gathers
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _masters_step(
    ref: nn.Module, masters: list[torch.Tensor], ref_opt: torch.optim.Optimizer, step: int
) -> None:
    """The reference's step: DDP on the bf16 model, its averaged grads upcast into the fp32
    copies, the plain optimizer on the copies, the copies cast back into the model."""
    ref.zero_grad()
    _loss(ref, step, dtype=torch.bfloat16).backward()
    for mp, p in zip(masters, ref.parameters(), strict=True):
        mp.grad = p.grad.float()
    ref_opt.step()
    with torch.no_grad():
        for mp, p in zip(masters, ref.parameters(), strict=True):
            p.copy_(mp)


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
        _masters_step(ref, masters, ref_opt, step)
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
def test_weights_written_after_the_wrapper_was_built_are_stepped_from() -> None:
    """shardkit-optim's [Note: Params written outside the optimizer] under ZeRO-2: weights
    loaded into the model after it was wrapped (and an in-place write right after a step, while
    the param gathers are still in flight) are what the next step starts from, as for DDP with
    fp32 copies re-seeded by hand; a write of the same values keeps the exact masters."""
    ref_m = _model().to(torch.bfloat16)
    m = copy.deepcopy(ref_m)
    torch.manual_seed(11)
    other = {k: torch.randn_like(v) for k, v in ref_m.state_dict().items()}
    ref = DDP(ref_m)
    masters = [p.detach().float().clone() for p in ref_m.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    opt = ShardedOptimizer(
        m.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
        master_dtype=torch.float32,
    )  # fmt: skip
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)
    writes = [
        lambda model: model.load_state_dict(model.state_dict()),  # same values: masters kept
        lambda model: model.load_state_dict(other),  # new weights after the wrapper was built
        lambda model: next(model.parameters()).mul_(0.5),  # in place, right after the step
    ]
    for step in range(4):
        _masters_step(ref, masters, ref_opt, step)
        opt.zero_grad()
        _loss(sdp, step, dtype=torch.bfloat16).backward()
        opt.step()
        if step < len(writes):
            with torch.no_grad():
                writes[step](ref_m)
                writes[step](m)
                for mp, p in zip(masters, ref_m.parameters(), strict=True):  # by hand
                    if not torch.equal(p, mp.to(p.dtype)):
                        mp.copy_(p)
    _equal(ref_m, m)
    full = opt.state_dict(all_ranks=True)
    for i, mp in enumerate(masters):
        assert torch.equal(full["master_params"][i], mp), i


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
    # one usage all-reduce per step, one byte per param (DDP with find_unused_parameters=True
    # all-reduces a usage map too); the per-step agreement is shardkit-optim's, on the c10d store
    nparam_tensors = len(list(m.parameters()))
    assert stats.calls["all_reduce"] == 1
    assert stats.buffer_bytes["all_reduce"] == nparam_tensors
    usage = 2 * (n - 1) / n * nparam_tensors
    assert stats.total_bytes() <= ddp_bytes * (1 + n * len(sdp._buckets) / nparams) + usage
    assert stats.calls["reduce_scatter"] == stats.calls["all_gather"] == len(sdp._buckets)
    assert sdp.memory_bytes()["grads"] == padded * 4 // n


@world(2)
def test_bad_input_raises() -> None:
    m = _model()
    with pytest.raises(TypeError, match="ShardedOptimizer"):
        ShardedDataParallel(m, torch.optim.SGD(m.parameters(), lr=0.1))  # type: ignore[arg-type]
    params = list(m.parameters())
    opt = ShardedOptimizer(params[:2], optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="in no optimizer"):
        ShardedDataParallel(m, opt)
    opt2 = ShardedOptimizer(params[1:], optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"param 0 of optimizer 1 .* is also in optimizer 0"):
        ShardedDataParallel(m, [opt, opt2])
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"reduce_fp16=True means reduce_dtype=torch\.float16"):
        ShardedDataParallel(m, opt, reduce_fp16=True, reduce_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reduce_dtype must be None or one of"):
        ShardedDataParallel(m, opt, reduce_dtype=torch.int8)
    with pytest.raises(TypeError, match="reduce_fp16 must be a bool, got str"):
        ShardedDataParallel(m, opt, reduce_fp16="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ShardedDataParallel(m, opt, bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"sharded_optimizer\[1\] is given twice"):
        ShardedDataParallel(m, [opt, opt])
    with pytest.raises(ValueError, match="empty list"):
        ShardedDataParallel(m, [])
    sub = dist.new_group([0, 1])
    opt3 = ShardedOptimizer(params[2:], optim=torch.optim.SGD, lr=0.1, group=sub)
    with pytest.raises(ValueError, match="another process group"):
        ShardedDataParallel(m, [ShardedOptimizer(params[:2], optim=torch.optim.SGD), opt3])


@world(2)
def test_rank_mismatch_in_bucket_plan_raises_everywhere() -> None:
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="ranks disagree on the gradient bucket plan"):
        ShardedDataParallel(m, opt, reduce_buffer_size=64 * (1 + dist.get_rank()))


@world(2)
def test_overlap_param_gather_matches_ddp() -> None:
    """Gathers left in flight after step() are waited on by each layer's forward pre-hook."""
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.Adam(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.Adam, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)  # overlap_param_gather: default
    for step in range(3):
        for model, o in ((ref, ref_opt), (sdp, opt)):
            _loss(model, step).backward()
            o.step()
        if step == 0:  # in flight until the next forward
            assert len(sdp._engine.groups[0].gather.pending) == len(sdp._buckets)
        ref_opt.zero_grad()
        opt.zero_grad()  # touches no param: the gathers stay in flight for the forward
        if step == 0:
            assert len(sdp._engine.groups[0].gather.pending) == len(sdp._buckets)
    _loss(ref, 3).backward()
    _loss(sdp, 3).backward()
    ref_opt.step()
    opt.step()
    assert sdp._engine.groups[0].gather.pending
    sd = m.state_dict()  # waits for the gathers still in flight
    assert not sdp._engine.groups[0].gather.pending
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


@world(2)
def test_reduce_fp16_matches_ddp_fp16_compress_hook() -> None:
    """fairscale's ``reduce_fp16=True`` (``reduce_dtype=torch.float16``) on an fp32 model against
    DDP with ``fp16_compress_hook``: at world 2, ``fp16(g) / 2`` (DDP) and ``fp16(g / 2)`` (here)
    are the same number (halving is exact), so the runs agree bit for bit, with ``no_sync()``
    accumulation too; the reduce-scatter moves half the fp32 bytes. (Two *synchronised*
    backwards without a step differ in the last bits: DDP adds the second local gradient to the
    already reduced one in ``.grad`` and compresses that sum again, this package adds the two
    reductions.)"""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref = DDP(ref_m)
    ref.register_comm_hook(None, fp16_compress_hook)  # type: ignore[no-untyped-call]
    ref_opt = torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64, reduce_fp16=True)
    assert sdp.reduce_dtype == torch.float16
    for step in range(4):
        for model, o in ((ref, ref_opt), (sdp, opt)):
            o.zero_grad()
            if step == 3:  # accumulation: one fp16 reduction of the local sum, as DDP's
                with model.no_sync():
                    _loss(model, step, 1).backward()
            _loss(model, step).backward()
            o.step()
        _equal(ref_m, m)
    stats = sdp.comm_stats
    padded = sum(b.numel for b in sdp._buckets)
    assert stats.buffer_bytes["reduce_scatter"] == 4 * padded * 2  # fp16 on the wire
    assert stats.buffer_bytes["all_gather"] == 4 * padded * 4  # params stay fp32


@world(2)
def test_bf16_model_reduced_in_fp32() -> None:
    """``reduce_dtype=torch.float32`` on a bf16 model with fp32 masters: gradients are summed in
    fp32 and rounded once to bf16 in the shard. Reference: the same bf16 gradients all-reduced
    in fp32 by hand, rounded to bf16, then plain AdamW on fp32 copies of the params."""
    m = _model().to(torch.bfloat16)
    ref_m = copy.deepcopy(m)
    masters = [p.detach().float().requires_grad_() for p in ref_m.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    opt = ShardedOptimizer(
        m.parameters(), optim=torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32
    )
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64, reduce_dtype=torch.float32)
    for step in range(3):
        opt.zero_grad()
        _loss(sdp, step, dtype=torch.bfloat16).backward()
        opt.step()
        ref_m.zero_grad()
        _loss(ref_m, step, dtype=torch.bfloat16).backward()
        for p, mp in zip(ref_m.parameters(), masters, strict=True):
            assert p.grad is not None
            g = p.grad.float() * 0.5
            dist.all_reduce(g)
            mp.grad = g.to(torch.bfloat16).float()
        ref_opt.step()
        with torch.no_grad():
            for p, mp in zip(ref_m.parameters(), masters, strict=True):
                p.copy_(mp)
        _equal(ref_m, m)
    padded = sum(b.numel for b in sdp._buckets)
    assert sdp.comm_stats.buffer_bytes["reduce_scatter"] == 3 * padded * 4


def _split_params(m: nn.Module) -> tuple[list[Any], list[Any]]:
    params = list(m.parameters())
    return params[:3], params[3:]


@world(2)
def test_two_optimizers_match_ddp() -> None:
    """fairscale's ``ShardedDataParallel(model, [opt1, opt2])``: each optimizer steps and
    gathers its own params. Two loops, both against DDP with two plain optimizers: one
    backward then both steps (bit for bit); and fairscale's ``step(closure)`` per optimizer,
    where the second optimizer's gradients accumulate over both closures' backwards (within
    rtol 1e-6 / atol 1e-7: DDP adds the second local gradient to the already reduced one in
    ``.grad`` and reduces that sum, so its float32 additions round in another order than this
    package's sum of the two reductions)."""
    for closures in (False, True):
        ref_m = _model()
        m = copy.deepcopy(ref_m)
        ra, rb = _split_params(ref_m)
        a, b = _split_params(m)
        ref = DDP(ref_m)
        ref_opts = [torch.optim.SGD(ra, lr=0.1, momentum=0.9), torch.optim.Adam(rb, lr=1e-2)]
        opts = [
            ShardedOptimizer(a, optim=torch.optim.SGD, lr=0.1, momentum=0.9),
            ShardedOptimizer(b, optim=torch.optim.Adam, lr=1e-2),
        ]
        sdp = ShardedDataParallel(m, opts, reduce_buffer_size=64)
        assert sdp.sharded_optimizers == opts
        for step in range(3):
            for model, os_ in ((ref, ref_opts), (sdp, opts)):
                for o in os_:
                    o.zero_grad()
                if closures:
                    for k, o in enumerate(os_):
                        o.step(lambda model=model, k=k, s=step: _loss(model, s, k).backward())
                else:
                    _loss(model, step).backward()
                    for o in os_:
                        o.step()
            if closures:  # see the docstring
                for x, y in zip(sdp.parameters(), ref_m.parameters(), strict=True):
                    torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
            else:
                _equal(ref_m, m)
        for k, o in enumerate(opts):  # per-optimizer state dicts, plain torch format
            full = o.state_dict(all_ranks=True)
            ref_sd = ref_opts[k].state_dict()
            assert full["param_groups"][0]["params"] == ref_sd["param_groups"][0]["params"]
            for i, st in ref_sd["state"].items():
                for key, v in st.items():
                    tol = {"rtol": 1e-5, "atol": 1e-6} if closures else {"rtol": 0, "atol": 0}
                    torch.testing.assert_close(full["state"][i][key], v, **tol)
        with pytest.raises(RuntimeError, match="wraps 2 optimizers"):
            _ = sdp.sharded_optimizer
        with pytest.raises(ValueError, match="name one"):
            sdp.optimizer_state_dict()
        by_object = sdp.optimizer_state_dict(opts[1])
        by_index = sdp.optimizer_state_dict(1)
        assert sorted(by_object["state"]) == sorted(by_index["state"]) == [0, 1, 2]
        assert torch.equal(by_object["state"][0]["exp_avg"], by_index["state"][0]["exp_avg"])
        with pytest.raises(ValueError, match="optimizer must be None, an index below 2"):
            sdp.optimizer_state_dict(5)


@world(2)
def test_two_optimizers_clip_by_the_norm_over_both() -> None:
    """``ddp.clip_grad_norm_`` clips by the norm over every optimizer's grads (torch's
    ``clip_grad_norm_`` over all params); ``opt_k.clip_grad_norm`` by its own params' norm."""
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    _, rb = _split_params(ref_m)
    a, b = _split_params(m)
    ref = DDP(ref_m)
    opts = [
        ShardedOptimizer(a, optim=torch.optim.SGD, lr=0.1),
        ShardedOptimizer(b, optim=torch.optim.SGD, lr=0.1),
    ]
    sdp = ShardedDataParallel(m, opts, reduce_buffer_size=64)
    _loss(ref, 0).backward()
    _loss(sdp, 0).backward()
    total = torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.01)
    torch.testing.assert_close(sdp.clip_grad_norm_(0.01), total, rtol=1e-6, atol=0)
    for o in opts:  # a gradient is clipped once (a second clip raises): reduce new ones
        o.zero_grad()
    ref_m.zero_grad()
    _loss(ref, 1).backward()
    _loss(sdp, 1).backward()
    own = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in rb if p.grad is not None]))
    torch.testing.assert_close(opts[1].clip_grad_norm(1e9), own, rtol=1e-5, atol=0)
