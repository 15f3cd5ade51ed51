"""fp32 master weights for bf16/fp16 models (``master_dtype``): parity, scaler, clip, state.

Reference (single process, on every rank): the same low-precision model, an fp32 copy of every
trainable param, the plain optimizer stepping the copies (grads upcast, then unscaled and
clipped in fp32 where the test says so), the copies cast back into the model. Every rank trains
on the same full batch (no DDP) unless DDP is named, so the sharded run must equal the reference
bit for bit; with DDP both runs reduce the same way. Clipping is compared within fp32 rounding
(the sharded norm sums partial norms in another order, as in test_features).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import (
    ShardedGradScaler,
    ShardedOptimizer,
    load_consolidated,
    load_sharded,
    save_sharded,
)
from shardkit.optim._master_set import MasterSet
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class _SignSGD(torch.optim.Optimizer):
    """A custom optimizer with per-param state."""

    def __init__(self, params: Any, lr: float = 0.01, decay: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "decay": decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "avg" not in st:
                    st["avg"] = torch.zeros_like(p)
                st["avg"].mul_(group["decay"]).add_(p.grad)
                p.add_(st["avg"].sign(), alpha=-group["lr"])
        return None


_OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sign": (_SignSGD, {"lr": 1e-3}),
}


def _model(dtype: torch.dtype = torch.bfloat16, frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8), nn.Linear(8, 3)
    )
    if frozen:
        m[2].requires_grad_(False)
    return m.to(dtype)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    ps = [p for p in model.parameters()]
    return [{"params": ps[:4]}, {"params": ps[4:], "lr": 3e-3}]


def _loss(model: nn.Module, step: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(12, 6, generator=g), torch.randn(12, 3, generator=g)
    out = model(x.to(dtype)).float()
    return nn.functional.mse_loss(out, y) * scale


class _Reference:
    """The plain optimizer on fp32 copies of a low-precision model (see the module docstring)."""

    def __init__(self, model: nn.Module, cls: type[torch.optim.Optimizer], **kw: Any) -> None:
        self.model = model
        self.master = {p: p.detach().float().clone() for p in model.parameters() if p.requires_grad}
        groups = []
        for g in _groups(model):
            ps = [self.master[p] for p in g["params"] if p in self.master]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps})
        self.opt = cls(groups, **kw)

    def step(self, inv_scale: torch.Tensor | None = None, clip: float | None = None) -> None:
        for p, m in self.master.items():
            m.grad = None if p.grad is None else p.grad.float()
            if m.grad is not None and inv_scale is not None:
                m.grad.mul_(inv_scale)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(self.master.values()), clip)
        self.opt.step()
        with torch.no_grad():
            for p, m in self.master.items():
                p.copy_(m)


def _assert_equal(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.dtype == q.dtype, name
        assert torch.equal(p, q), f"{what}: {name} differs by {(p.float() - q.float()).abs().max()}"


# ---------------------------------------------------------------------------- parity


@pytest.mark.parametrize("optim", list(_OPTIMS))
@pytest.mark.parametrize("chunk", [64, None])
@world(2)
def test_parity_world2(optim: str, chunk: int | None) -> None:
    _parity(optim, chunk, frozen=False)


@pytest.mark.parametrize("optim", ["adamw", "sign"])
@world(3)
def test_parity_world3_frozen(optim: str) -> None:
    _parity(optim, 256, frozen=True)


def _parity(optim: str, chunk: int | None, frozen: bool) -> None:
    cls, kw = _OPTIMS[optim]
    ref = _Reference(_model(frozen=frozen), cls, **kw)
    model = _model(frozen=frozen)
    opt = ShardedOptimizer(
        _groups(model), cls, master_dtype=torch.float32, master_grad_bucket_bytes=chunk, **kw
    )
    for step in range(5):
        for m in (ref.model, model):
            m.zero_grad()
            _loss(m, step).backward()
        ref.step()
        opt.step()
        _assert_equal(model, ref.model, f"{optim} step {step}")
    # the state is fp32 and keyed by the masters; the masters are the reference's, exactly
    opt.consolidate_state_dict(0)
    if dist.get_rank() == 0:
        sd = opt.state_dict()
        params = [p for g in _groups(model) for p in g["params"]]
        ref_params = [p for g in _groups(ref.model) for p in g["params"]]
        assert sorted(sd["master_params"]) == [i for i, p in enumerate(params) if p.requires_grad]
        for i, value in sd["master_params"].items():
            assert value.dtype == torch.float32
            assert torch.equal(value, ref.master[ref_params[i]])
        for st in sd["state"].values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    assert v.dtype == torch.float32


@pytest.mark.parametrize(
    ("optim", "interleaved", "shard_buckets", "reduce_to_owner"),
    [
        ("adam", True, False, False),
        ("sgd", False, False, False),
        ("adamw", True, True, False),
        ("adam", False, True, True),
        ("sign", True, False, True),
    ],
)
@world(2)
def test_parity_with_ddp_and_overlap_hooks(
    optim: str, interleaved: bool, shard_buckets: bool, reduce_to_owner: bool
) -> None:
    """The per-bucket local step of shardkit-overlap steps the masters of each bucket, in
    every mode of the hooks."""
    overlap = pytest.importorskip("shardkit.overlap")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    cls, kw = _OPTIMS[optim]
    ref_model, model = _model(), _model()
    ref_ddp = DDP(ref_model, bucket_cap_mb=0.0005)
    ddp = DDP(model, bucket_cap_mb=0.0005)
    ref_ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    ref = _Reference(ref_model, cls, **kw)
    opt = ShardedOptimizer(
        _groups(model), cls, master_dtype=torch.float32, master_grad_bucket_bytes=128, **kw
    )
    handle = overlap.register_zero_overlap(
        ddp,
        opt,
        interleaved=interleaved,
        shard_buckets=shard_buckets,
        reduce_to_owner=reduce_to_owner,
    )
    try:
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank())
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            for d in (ref_ddp, ddp):
                nn.functional.mse_loss(d(x.bfloat16()).float(), y).backward()
            ref.step()
            opt.step()
            _assert_equal(model, ref_model, f"{optim} {interleaved} step {step}")
            opt.zero_grad()
            ref_model.zero_grad()
    finally:
        handle.close()


@world(2)
def test_overlap_with_fp16_scaler_and_clipping_in_the_loop() -> None:
    """register_zero_overlap(grad_scaler=..., max_grad_norm=...) with masters: the step runs in
    the loop, unscaled and clipped in fp32 (clipping within fp32 rounding of the reference)."""
    overlap = pytest.importorskip("shardkit.overlap")
    ref_model, model = _model(torch.float16), _model(torch.float16)
    ref_ddp, ddp = DDP(ref_model), DDP(model)
    ref = _Reference(ref_model, torch.optim.Adam, lr=1e-3)
    opt = ShardedOptimizer(_groups(model), torch.optim.Adam, lr=1e-3, master_dtype=torch.float32)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**4, group=opt.group)
    handle = overlap.register_zero_overlap(ddp, opt, grad_scaler=scaler, max_grad_norm=0.5)
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(7 * step + dist.get_rank())
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            nn.functional.mse_loss(ref_ddp(x.half()).float(), y).mul(2.0**4).backward()
            scaler.scale(nn.functional.mse_loss(ddp(x.half()).float(), y)).backward()
            ref.step(inv_scale=torch.tensor(2.0**-4), clip=0.5)
            scaler.unscale_(opt)
            opt.clip_grad_norm(0.5)
            scaler.step(opt)
            scaler.update()
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=2e-3, atol=1e-5)  # fp16: 1 ulp
            opt.zero_grad()
            ref_model.zero_grad()
    finally:
        handle.close()


@world(2)
def test_params_already_in_master_dtype_are_a_noop() -> None:
    """An fp32 model with master_dtype=float32: no copies, the same run as without masters."""
    a, b = _model(torch.float32), _model(torch.float32)
    oa = ShardedOptimizer(_groups(a), torch.optim.Adam, lr=1e-2, master_dtype=torch.float32)
    ob = ShardedOptimizer(_groups(b), torch.optim.Adam, lr=1e-2)
    assert oa._zero1().masters is not None and len(oa._zero1().masters) == 0
    for step in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
    _assert_equal(a, b, "fp32 model")


@world(2)
def test_master_grad_chunks_bound_the_upcast(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    original = MasterSet.load

    def recording(self: MasterSet, *args: Any) -> list[torch.Tensor]:
        flats = original(self, *args)
        sizes.append(sum(f.numel() * f.element_size() for f in flats))
        return flats

    monkeypatch.setattr(MasterSet, "load", recording)
    model = _model()
    opt = ShardedOptimizer(
        model.parameters(), torch.optim.Adam, master_dtype=torch.float32, master_grad_bucket_bytes=512
    )
    _loss(model, 0).backward()
    opt.step()
    largest = max(p.numel() * 4 for p in opt.owned_params)
    assert len(sizes) > 1 and max(sizes) <= max(512, largest)
    assert sum(sizes) == sum(p.numel() * 4 for p in opt.owned_params)


# ---------------------------------------------------------------------------- scaler and clip


@world(2)
def test_fp16_scaler_unscales_in_fp32_and_skips_on_every_rank() -> None:
    """fp16 model: inf grads at the huge initial scale skip the step on every rank, then the
    scaler backs off; the unscale happens on the fp32 grads (a tiny gradient that fp16
    unscaling would flush to zero still moves the master)."""
    ref = _Reference(_model(torch.float16), torch.optim.Adam, lr=1e-3)
    model = _model(torch.float16)
    opt = ShardedOptimizer(_groups(model), torch.optim.Adam, lr=1e-3, master_dtype=torch.float32)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**30, backoff_factor=2.0**-8, group=opt.group)
    ref_scale = 2.0**30
    skipped = 0
    for step in range(6):
        for m in (ref.model, model):
            m.zero_grad()  # the model's, not the optimizer's: pending factors must not leak
        scaler.scale(_loss(model, step)).backward()
        (_loss(ref.model, step) * ref_scale).backward()
        finite = all(torch.isfinite(p.grad).all() for p in ref.model.parameters() if p.grad is not None)
        if finite:
            ref.step(inv_scale=torch.tensor(ref_scale, dtype=torch.float64).reciprocal().float())
        else:
            skipped += 1
            ref_scale *= 2.0**-8
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == ref_scale, step
        _assert_equal(model, ref.model, f"fp16 step {step}")
    assert 1 <= skipped < 6
    # fp16 unscaling of a gradient of 2^-20 scaled by 2^10 would give 2^-30 (below fp16's
    # smallest subnormal 2^-24): zero. In fp32 it survives.
    p = next(model.parameters())
    opt.zero_grad()
    p.grad = torch.full_like(p, 2.0**-10)
    scaler2 = ShardedGradScaler("cpu", init_scale=2.0**20, group=opt.group)
    scaler2.scale(torch.ones(()))
    scaler2.unscale_(opt)
    assert torch.equal(p.grad, torch.full_like(p, 2.0**-10))  # the fp16 grad is untouched
    assert opt._zero1().masters is not None and list(opt._zero1().masters.factors)[0].item() == 2.0**-20


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@world(2)
def test_clip_in_fp32_from_the_upcast_grads(norm_type: float) -> None:
    ref = _Reference(_model(), torch.optim.SGD, lr=0.1)
    model = _model()
    opt = ShardedOptimizer(_groups(model), torch.optim.SGD, lr=0.1, master_dtype=torch.float32)
    for m in (ref.model, model):
        _loss(m, 0, scale=50.0).backward()
    raw = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    total = opt.clip_grad_norm(0.5, norm_type)
    masters = list(ref.master.values())
    for p, m in ref.master.items():
        m.grad = p.grad.float()  # type: ignore[union-attr]
    expected = torch.nn.utils.clip_grad_norm_(masters, 0.5, norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for p, g in zip(model.parameters(), raw, strict=True):
        assert torch.equal(p.grad, g)  # the bf16 grads are not clipped in place (lossy)
    opt.step()
    ref.opt.step()
    with torch.no_grad():
        for p, m in ref.master.items():
            p.copy_(m)
    for p, q in zip(model.parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-6)  # bf16: one ulp apart at most
    opt.consolidate_state_dict(-1)
    params = list(ref.model.parameters())
    for i, v in opt.state_dict()["master_params"].items():
        torch.testing.assert_close(v, ref.master[params[i]], rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------- state


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def _sharded(model: nn.Module) -> ShardedOptimizer:
    return ShardedOptimizer(
        _groups(model), torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32,
        master_grad_bucket_bytes=256,
    )  # fmt: skip


@world(2)
def test_consolidated_dict_reloads_at_another_world_and_continues_exactly() -> None:
    ref = _Reference(_model(), torch.optim.AdamW, lr=1e-2)
    for step in range(5):
        ref.model.zero_grad()
        _loss(ref.model, step).backward()
        ref.step()
    model = _model()
    opt = _sharded(model)
    _train(model, opt, 3)
    opt.consolidate_state_dict(-1)
    sd = opt.state_dict()
    # a plain torch optimizer loads it (extra key ignored)
    plain = torch.optim.AdamW([torch.zeros(1)], lr=1.0)
    plain.load_state_dict({**sd, "param_groups": [{**sd["param_groups"][0], "params": [0]}],
                           "state": {}})  # fmt: skip
    # a world of 1 (a sub group) reloads it and continues bit for bit
    solo = dist.new_group([dist.get_rank()])
    model1 = copy.deepcopy(model)
    opt1 = ShardedOptimizer(
        _groups(model1), torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32, group=solo
    )
    opt1.load_state_dict(sd)
    _train(model1, opt1, 2, start=3)
    _assert_equal(model1, ref.model, "reloaded at world 1")
    _train(model, opt, 2, start=3)
    _assert_equal(model, ref.model, "uninterrupted")


@world(2)
def test_load_without_masters_takes_the_live_params_and_mismatches_raise() -> None:
    model = _model()
    opt = _sharded(model)
    _train(model, opt, 2)
    opt.consolidate_state_dict(-1)
    sd = opt.state_dict()
    bad = {**sd, "master_params": {0: torch.zeros(3, 3)}}
    with pytest.raises(ValueError, match=r"master_params.*\[0\] has shape \(3, 3\)"):
        opt.load_state_dict(bad)
    with pytest.raises(TypeError, match="must be a dict of global param index"):
        opt.load_state_dict({**sd, "master_params": [1, 2]})
    without = {k: v for k, v in sd.items() if k != "master_params"}
    opt.load_state_dict(without)
    assert opt._zero1().masters is not None
    for p in opt.owned_params:
        m = opt._zero1().masters.value(p)
        assert m is not None and torch.equal(m, p.float())


@world(2)
def test_full_precision_export_and_import() -> None:
    model = _model()
    opt = _sharded(model)
    _train(model, opt, 3)
    full = opt.master_model_state_dict(model, recipient_rank=-1)
    assert full is not None and full.keys() == model.state_dict().keys()
    opt.consolidate_state_dict(-1)
    masters = opt.state_dict()["master_params"]
    names = [n for n, _ in model.named_parameters()]
    for i, value in masters.items():
        assert torch.equal(full[names[i]], value)
    for name, value in full.items():
        assert value.dtype == torch.float32 and value.device.type == "cpu"
        assert torch.equal(value.to(torch.bfloat16), model.state_dict()[name])
    # fp32 weights into a fresh bf16 model + masters: the masters are exact, the model rounded
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    opt2 = _sharded(fresh)
    opt2.load_master_model_state_dict(fresh, full)
    _assert_equal(fresh, model, "imported")
    got = opt2.master_model_state_dict(fresh, recipient_rank=-1)
    assert got is not None
    for name in full:
        assert torch.equal(got[name], full[name])
    plain = ShardedOptimizer(fresh.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="needs master weights"):
        plain.master_model_state_dict(fresh)


@world(2)
def test_repartition_moves_the_exact_masters() -> None:
    """refresh_trainable / add_param_group: a param that changes owner keeps its fp32 value."""
    model = _model()
    ps = list(model.parameters())
    opt = ShardedOptimizer(ps[:6], torch.optim.Adam, lr=1e-2, master_dtype=torch.float32)
    _train(model, opt, 2)
    before = opt.master_model_state_dict(model, recipient_rank=-1)
    opt.add_param_group({"params": ps[6:]})  # repartitions: owners change
    after = opt.master_model_state_dict(model, recipient_rank=-1)
    assert before is not None and after is not None
    names = [n for n, _ in model.named_parameters()]
    for name in names[:6]:
        assert torch.equal(after[name], before[name]), name
    for name, p in zip(names[6:], ps[6:], strict=True):  # new params: masters from the live ones
        assert torch.equal(after[name], p.detach().float())


# ---------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("master_ckpt")


_K, _J = 3, 2


def _save(root: Path) -> None:
    model = _model()
    opt = _sharded(model)
    _train(model, opt, _K)
    save_sharded(opt, root / f"w{dist.get_world_size()}")
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), root / f"w{dist.get_world_size()}.model.pt")
    dist.barrier()


def _resume(root: Path, saved_world: int) -> None:
    ref = _Reference(_model(), torch.optim.AdamW, lr=1e-2)
    for step in range(_K + _J):
        ref.model.zero_grad()
        _loss(ref.model, step).backward()
        ref.step()
    model = _model()
    model.load_state_dict(torch.load(root / f"w{saved_world}.model.pt"))
    with torch.no_grad():
        for p in model.parameters():  # the masters must come from the checkpoint, not these
            p.add_(0.5)
    opt = _sharded(model)
    load_sharded(opt, root / f"w{saved_world}")
    model.load_state_dict(torch.load(root / f"w{saved_world}.model.pt"))
    _train(model, opt, _J, start=_K)
    _assert_equal(model, ref.model, f"saved at world {saved_world}, resumed at "
                                    f"{dist.get_world_size()}")  # fmt: skip


@world(2)
def test_save_world2(ckpt_root: Path) -> None:
    _save(ckpt_root)


@world(4)
def test_save_world4(ckpt_root: Path) -> None:
    _save(ckpt_root)


@world(3)
def test_resume_2_to_3(ckpt_root: Path) -> None:
    _resume(ckpt_root, 2)


@world(2)
def test_resume_4_to_2(ckpt_root: Path) -> None:
    _resume(ckpt_root, 4)


@world(1)
def test_resume_2_to_1(ckpt_root: Path) -> None:
    _resume(ckpt_root, 2)


def test_offline_consolidated_checkpoint_has_the_masters(ckpt_root: Path) -> None:
    sd = load_consolidated(ckpt_root / "w2")
    n = sum(p.requires_grad for p in _model().parameters())
    assert len(sd["master_params"]) == n
    assert all(v.dtype == torch.float32 for v in sd["master_params"].values())


# ---------------------------------------------------------------------------- bad input


@world(1)
def test_bad_master_arguments() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"master_dtype must be a floating torch.dtype.*int32"):
        ShardedOptimizer(model.parameters(), master_dtype=torch.int32)
    with pytest.raises(TypeError, match="got str: 'float32'"):
        ShardedOptimizer(model.parameters(), master_dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="broadcast_fp16=True cannot be combined"):
        ShardedOptimizer(model.parameters(), broadcast_fp16=True, master_dtype=torch.float32)
    with pytest.raises(ValueError, match="master_grad_bucket_bytes must be a positive int"):
        ShardedOptimizer(
            model.parameters(), master_dtype=torch.float32, master_grad_bucket_bytes=0
        )


def test_grad_scaler_unscale_hook_pin() -> None:
    """Pins the torch internal ShardedGradScaler overrides (see _torch_compat): unscale_ calls
    ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)`` and keeps its result as
    the optimizer's found-inf flags."""
    calls: list[tuple[Any, ...]] = []

    class Probe(torch.amp.GradScaler):
        def _unscale_grads_(self, optimizer: Any, inv_scale: Any, found_inf: Any, allow_fp16: Any) -> Any:  # type: ignore[override]  # fmt: skip
            calls.append((optimizer, inv_scale.item(), allow_fp16))
            return {torch.device("cpu"): torch.ones(())}

    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = Probe("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    assert calls == [(opt, 0.25, False)]
    assert scaler.step(opt) is None  # found_inf from the hook: the step is skipped
    assert torch.equal(p, torch.ones(2))


# ---------------------------------------------------------------------------- written params


@pytest.mark.parametrize("chunk", [64, None])
@world(2)
def test_weights_written_after_the_optimizer_was_built_are_stepped_from(chunk: int | None) -> None:
    """[Note: Params written outside the optimizer]: ``model.load_state_dict`` (and an in-place
    write) after the optimizer was built are what the next step starts from, as for the plain
    reference; a write of the same values keeps the exact masters."""
    cls, kw = _OPTIMS["adamw"]
    ref = _Reference(_model(), cls, **kw)
    model = _model()
    opt = ShardedOptimizer(
        _groups(model), cls, master_dtype=torch.float32, master_grad_bucket_bytes=chunk, **kw
    )
    torch.manual_seed(7)
    other = _model().apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    writes = [
        lambda m: m.load_state_dict(m.state_dict()),  # the same values: masters kept
        lambda m: m.load_state_dict(other.state_dict()),  # new weights after the optimizer
        lambda m: m[0].weight.mul_(0.5),  # an in-place write to one param
    ]
    for step in range(4):
        for m in (ref.model, model):
            m.zero_grad()
            _loss(m, step).backward()
        ref.step()
        opt.step()
        _assert_equal(ref.model, model, f"step {step}")
        if step < len(writes):
            with torch.no_grad():
                for m in (ref.model, model):
                    writes[step](m)
            for p, master in ref.master.items():  # the reference's user re-seeds by hand
                if not torch.equal(p, master.to(p.dtype)):
                    master.copy_(p)
    got = opt.master_model_state_dict(model, recipient_rank=-1)
    assert got is not None
    for (name, p), want in zip(model.named_parameters(), ref.master.values(), strict=True):
        assert torch.equal(got[name], want), name
