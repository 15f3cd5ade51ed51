"""ShardedDataParallel: buffer broadcast, fp16 loss scaling with ShardedGradScaler, DCP sharded
checkpoints, requires_grad changes. References are torch DDP (+ the plain
optimizer / torch's GradScaler) at world 2, where the reduction is order-independent, so the
comparisons are bit for bit unless a test states a tolerance."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedGradScaler, ShardedOptimizer, load_sharded, save_sharded
from shardkit.partition import all_gather_objects
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3)
    )


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


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


@pytest.mark.parametrize("broadcast", [True, False])
@world(2)
def test_broadcast_buffers_matches_ddp(broadcast: bool) -> None:
    """BatchNorm running stats, ranks starting from different buffers and seeing different
    data, through no_sync() micro-batches and no_grad eval forwards: params, buffers and eval
    outputs equal DDP's on every rank (DDP broadcasts before a forward only when the previous
    one ran with grad enabled outside no_sync())."""
    ref_m = _bn_model()
    m = copy.deepcopy(ref_m)
    ref = DDP(ref_m, broadcast_buffers=broadcast)
    ref_opt = torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(m, opt, broadcast_buffers=broadcast, reduce_buffer_size=64)
    rank = dist.get_rank()
    with torch.no_grad():
        for model in (ref_m, m):  # after the wrappers' start-up sync: ranks differ
            bn = model[1]
            assert isinstance(bn, nn.BatchNorm1d)
            bn.running_mean.fill_(0.5 * rank)
            bn.running_var.fill_(1.0 + rank)
    for step in range(3):
        outs = []
        for model, o in ((ref, ref_opt), (sdp, opt)):
            model.train()
            o.zero_grad()
            with model.no_sync():
                _loss(model, step, 0).backward()
            _loss(model, step, 1).backward()
            o.step()
            model.eval()
            with torch.no_grad():
                outs.append(model(_batch(step, 2)[0]))
        assert torch.equal(outs[0], outs[1]), step
    _equal(ref_m, m)
    for (n, a), b in zip(ref_m.named_buffers(), m.buffers(), strict=True):
        assert torch.equal(a, b), n
    means = all_gather_objects(m[1].running_mean.clone(), None)
    assert torch.equal(means[0], means[1]) == broadcast  # rank 0's stats won, or each its own


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@world(2)
def test_sharded_grad_scaler_matches_ddp_amp(dtype: torch.dtype) -> None:
    """fp16 model + fp32 masters (or fp32 without masters) with ShardedGradScaler vs DDP +
    torch's GradScaler + the plain optimizer over fp32 copies. At step 2 rank 1 injects an inf
    into one element of a gradient: after the reduce-scatter only that element's owner sees it,
    and both ranks skip the step and back off the scale. Params and masters bit for bit; the
    clip norm over the unscaled grads within rtol 1e-5 (another summation order)."""
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
    masters_dtype = torch.float32 if dtype != torch.float32 else None
    ref_m = _mlp().to(dtype)
    m = copy.deepcopy(ref_m)
    ref = DDP(ref_m)
    masters = [p.detach().float().clone() for p in ref_m.parameters()]
    ref_opt = torch.optim.AdamW(masters if masters_dtype else list(ref_m.parameters()), **kw)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    extra = {"master_dtype": masters_dtype} if masters_dtype else {}
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, **extra, **kw)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**12, growth_interval=2, group=opt.group)
    local_found: list[float] = []
    unscale = opt._unscale_for_scaler

    def spy(inv_scale: torch.Tensor) -> Any:
        found = unscale(inv_scale)
        local_found.append(max((v.item() for v in found.values()), default=0.0))
        return found

    opt._unscale_for_scaler = spy  # type: ignore[method-assign]
    bad = 2  # the step where rank 1 injects an inf
    scales = []
    for step in range(5):
        scales.append(scaler.get_scale())
        hooks = []
        if step == bad and dist.get_rank() == 1:
            for model in (ref_m, m):
                w = model[4].weight

                def poison(g: torch.Tensor) -> torch.Tensor:
                    g = g.clone()
                    g[0, 0] = float("inf")
                    return g

                hooks.append(w.register_hook(poison))
        ref_m.zero_grad()
        ref_scaler.scale(_loss(ref, step, dtype=dtype)).backward()
        if masters_dtype:
            for mp, p in zip(masters, ref_m.parameters(), strict=True):
                mp.grad = p.grad.float()
        ref_scaler.unscale_(ref_opt)
        want = torch.nn.utils.clip_grad_norm_(masters if masters_dtype else ref_m.parameters(), 1e9)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        if masters_dtype:
            with torch.no_grad():
                for mp, p in zip(masters, ref_m.parameters(), strict=True):
                    p.copy_(mp)
        opt.zero_grad()
        scaler.scale(_loss(sdp, step, dtype=dtype)).backward()
        scaler.unscale_(opt)
        got = opt.clip_grad_norm(1e9)  # coefficient 1.0: the step stays bit-exact
        scaler.step(opt)
        scaler.update()
        for h in hooks:
            h.remove()
        assert scaler.get_scale() == ref_scaler.get_scale(), step
        if step != bad:
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=0)
        _equal(ref_m, m)
    assert scales[bad + 1] == scales[bad] / 2  # the skipped step backed the scale off
    assert max(scales) > scales[0]  # and the others grew it: steps were really taken
    flags = all_gather_objects(local_found[bad], None)
    assert sorted(flags) == [0.0, 1.0], flags  # one rank saw the inf, both skipped
    assert all(f == 0.0 for i, f in enumerate(local_found) if i != bad)
    if masters_dtype:
        full = opt.state_dict(all_ranks=True)
        for i, mp in enumerate(masters):
            assert torch.equal(full["master_params"][i], mp), i


@pytest.mark.parametrize("kind", ["adamw-bf16-masters", "sgd-momentum"])
@world(2)
def test_save_load_sharded_resumes_bit_exact(kind: str, tmp_path: Path) -> None:
    """shardkit-optim's DCP save_sharded / load_sharded on a wrapped optimizer: the loaded
    state equals the saved one, and the resumed run equals the uninterrupted run bit for bit.
    A checkpoint written by an unwrapped ShardedOptimizer loads into a wrapped one too."""
    bf16 = kind.startswith("adamw")
    dtype = torch.bfloat16 if bf16 else torch.float32
    cls: Any = torch.optim.AdamW if bf16 else torch.optim.SGD
    kw: dict[str, Any] = {"lr": 1e-2, "master_dtype": torch.float32} if bf16 else {}
    if not bf16:
        kw = {"lr": 0.1, "momentum": 0.9}

    def build(m: nn.Module) -> tuple[ShardedDataParallel, ShardedOptimizer]:
        o = ShardedOptimizer(m.parameters(), optim=cls, **kw)
        return ShardedDataParallel(m, o, reduce_buffer_size=64), o

    m = _mlp().to(dtype)
    sdp, opt = build(m)
    for step in range(2):
        opt.zero_grad()
        _loss(sdp, step, dtype=dtype).backward()
        opt.step()
    save_sharded(opt, tmp_path / "ckpt")
    want = opt.state_dict(all_ranks=True)
    m2 = _mlp().to(dtype)
    m2.load_state_dict(m.state_dict())
    sdp2, opt2 = build(m2)
    load_sharded(opt2, tmp_path / "ckpt")
    got = opt2.state_dict(all_ranks=True)
    assert sorted(got["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got["state"][i][k]), torch.as_tensor(v)), (i, k)
    for i, v in want.get("master_params", {}).items():
        assert torch.equal(got["master_params"][i], v), i
    for step in range(2, 4):
        for model, o in ((sdp, opt), (sdp2, opt2)):
            o.zero_grad()
            _loss(model, step, dtype=dtype).backward()
            o.step()
    _equal(m, m2)
    # from an unwrapped ShardedOptimizer (whole params per owner) into a wrapped one
    plain_m = _mlp().to(dtype)
    plain = ShardedOptimizer(plain_m.parameters(), optim=cls, **kw)
    for step in range(2):
        plain.zero_grad()
        _loss(plain_m, step, dtype=dtype).backward()
        for p in plain_m.parameters():  # average as data parallelism would
            dist.all_reduce(p.grad)
            p.grad.div_(2)
        plain.step()
    save_sharded(plain, tmp_path / "plain")
    plain.consolidate_state_dict(-1)
    ref = plain.state_dict()
    m3 = _mlp().to(dtype)
    m3.load_state_dict(plain_m.state_dict())
    _, opt3 = build(m3)
    load_sharded(opt3, tmp_path / "plain")
    got3 = opt3.state_dict(all_ranks=True)
    for i, st in ref["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got3["state"][i][k]), torch.as_tensor(v)), (i, k)


@world(2, timeout=60)
def test_requires_grad_change_on_one_rank_raises_everywhere() -> None:
    """Rank 1 freezes a param after construction. Without auto refresh the next step raises on
    both ranks (in the optimizer's per-step agreement, before any shard moves) instead of rank 1
    alone while rank 0 waits in the all-gathers; with it (default) rank 1's next forward starts
    a refresh that rank 0 is not in, and both ranks raise, naming the two calls."""
    for auto in (False, True):
        m = _mlp()
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64, auto_refresh_trainable=auto)
        _loss(sdp, 0).backward()
        opt.step()
        calls = sdp.comm_stats.calls["all_reduce"]
        if dist.get_rank() == 1:
            m[0].weight.requires_grad_(False)
        opt.zero_grad()
        before = [p.detach().clone() for p in sdp.parameters()]  # waits for the gathers
        if auto:
            with pytest.raises(RuntimeError, match=r"refresh_trainable\(\)"):
                _loss(sdp, 1).backward()
        else:
            _loss(sdp, 1).backward()
            with pytest.raises(RuntimeError, match=r"requires_grad changed .* on rank 1"):
                opt.step()
        # the agreements are shardkit-optim's (on the c10d store): no collective of the wrapper
        # ran, and nothing moved
        assert sdp.comm_stats.calls["all_reduce"] == calls
        assert all(torch.equal(a, b) for a, b in zip(before, sdp.parameters(), strict=True))


@world(2)
def test_sharded_grad_scaler_refuses_fp16_grads_without_masters() -> None:
    """As torch's GradScaler: float16 gradients are not unscaled in float16 (every rank)."""
    m = _mlp().to(torch.float16)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=64)
    scaler = ShardedGradScaler("cpu", group=opt.group)
    scaler.scale(_loss(sdp, 0, dtype=torch.float16)).backward()
    with pytest.raises(ValueError, match=r"master_dtype=torch\.float32"):
        scaler.unscale_(opt)
