"""``master_remainder=True`` under ZeRO-1 ([Note: Remainder masters under ZeRO-1]): bf16 params
with int16 remainders step bit for bit as with ``master_dtype=torch.float32``.

The comparisons run a remainder optimizer ``B`` and an fp32-master optimizer ``A`` side by side
on the same batches (the same on every rank, so DDP's average is exact). Each step starts from
the same state: after comparing, ``A`` takes ``B``'s params and state dict, which also proves
that a remainder dict loads into an fp32-master optimizer exactly. Only the params may differ
from the fp32 run's rounding, where a master's low half is exactly a tie (see [Note: Exact
16-bit remainder masters]): they must equal ``split_master(master)[0]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _optim_testkit import save_run
from shardkit.optim import ShardedOptimizer, load_sharded
from shardkit.optim._compact import CompactTensor
from shardkit.optim._master_set import MasterSet
from shardkit.optim._remainder import split_master
from shardkit.testing import live_storages, world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

_OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def _model(big: bool = False, fp16_tail: bool = False) -> nn.Module:
    """bf16 layers (8192-element weights when ``big``: compact moments), the last one fp16
    when ``fp16_tail`` (a full fp32 master)."""
    torch.manual_seed(0)
    width = 512 if big else 16
    tail = torch.float16 if fp16_tail else torch.bfloat16
    m = nn.Sequential(
        nn.Linear(16, width),
        nn.Tanh(),
        nn.Linear(width, 16),
        nn.Tanh(),
        _Cast(tail),
        nn.Linear(16, 3),
    ).to(torch.bfloat16)
    m[5].to(tail)
    return m


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    ps = list(model.parameters())
    return [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3}]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)
    return nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)


def _opt(model: nn.Module, name: str, remainder: bool, **kw: Any) -> ShardedOptimizer:
    cls, args = _OPTIMS[name]
    return ShardedOptimizer(
        _groups(model), cls, master_dtype=torch.float32, master_remainder=remainder,
        **{**args, **kw},
    )  # fmt: skip


def _masters(opt: ShardedOptimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    got = opt.master_model_state_dict(model, recipient_rank=-1)
    assert got is not None
    return got


def _check_step(model_a: nn.Module, a: ShardedOptimizer, model_b: nn.Module,
                b: ShardedOptimizer, what: str) -> None:  # fmt: skip
    """Masters bit for bit; B's params the ties-away rounding of them, A's ``.to()``."""
    ma, mb = _masters(a, model_a), _masters(b, model_b)
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(ma[name], mb[name]), f"{what}: master of {name}"
        assert torch.equal(pa, ma[name].to(pa.dtype)), f"{what}: fp32 run's {name}"
        if pb.dtype == torch.bfloat16:
            assert torch.equal(pb, split_master(mb[name])[0]), f"{what}: {name}"
        else:
            assert torch.equal(pb, pa), f"{what}: {name} ({pb.dtype}, full master)"


def _resync(model_a: nn.Module, a: ShardedOptimizer, model_b: nn.Module,
            b: ShardedOptimizer) -> None:  # fmt: skip
    """A continues from B's exact state: B's params, then B's dict (masters, moments)."""
    model_a.load_state_dict(model_b.state_dict())
    a.load_state_dict(b.state_dict(all_ranks=True))


def _step_each(runs: tuple[tuple[nn.Module, ShardedOptimizer], ...], step: int) -> None:
    """One training step of each ``(model or DDP, optimizer)`` on batch ``step``."""
    for model, opt in runs:
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


@pytest.mark.parametrize("name", list(_OPTIMS))
@pytest.mark.parametrize("chunk", [256, None])
@world(2)
def test_steps_bit_for_bit_as_fp32_masters_under_ddp(name: str, chunk: int | None) -> None:
    model_a, model_b = _model(fp16_tail=True), _model(fp16_tail=True)
    ddp_a, ddp_b = DDP(model_a), DDP(model_b)
    a = _opt(model_a, name, False, master_grad_bucket_bytes=chunk)
    b = _opt(model_b, name, True, master_grad_bucket_bytes=chunk)
    for step in range(4):
        for ddp, opt in ((ddp_a, a), (ddp_b, b)):
            opt.zero_grad()
            _loss(ddp, step).backward()
            if step % 2:  # the clip coefficient is applied to the fp32 grads, as for masters
                opt.clip_grad_norm(0.05)
            opt.step()
        _check_step(model_a, a, model_b, b, f"{name}, step {step}")
        _resync(model_a, a, model_b, b)
    # the dicts are interchangeable: the same keys, the same exact values
    sa, sb = a.state_dict(all_ranks=True), b.state_dict(all_ranks=True)
    assert sa["master_params"].keys() == sb["master_params"].keys()
    for i, m in sb["master_params"].items():
        assert m.dtype == torch.float32 and torch.equal(m, sa["master_params"][i])
    for i, st in sb["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sa["state"][i][k])), (i, k)


@world(2)
def test_ties_round_away_from_zero_and_the_masters_stay_exact() -> None:
    """Masters whose low half is exactly 0x8000 with an even truncation: B's params are one
    bf16 unit further from zero than ``.to()``, and the masters are still A's, bit for bit."""
    model_a, model_b = _model(), _model()
    a, b = _opt(model_a, "adamw", False), _opt(model_b, "adamw", True)
    ties = {}
    for name, p in model_a.named_parameters():
        bits = p.detach().float().view(torch.int32)
        bits = (bits & ~0x1FFFF) | 0x8000  # an even truncation, low half a tie
        ties[name] = bits.view(torch.float32)
    for model, opt in ((model_a, a), (model_b, b)):
        opt.load_master_model_state_dict(model, ties)
    _check_step(model_a, a, model_b, b, "loaded ties")
    differ = sum(
        int((pb != pa).sum())
        for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True)
    )
    assert differ > 0  # nonzero ties: away from zero differs from ties to even
    _resync(model_a, a, model_b, b)
    for step in range(2):
        _step_each(((model_a, a), (model_b, b)), step)
        _check_step(model_a, a, model_b, b, f"step {step} after ties")
        _resync(model_a, a, model_b, b)


@world(2)
def test_compact_moments_with_remainders() -> None:
    model_a, model_b = _model(big=True), _model(big=True)
    kw = {"compact_state": "int8", "master_grad_bucket_bytes": 40_000}
    a, b = _opt(model_a, "adamw", False, **kw), _opt(model_b, "adamw", True, **kw)
    for step in range(3):
        _step_each(((model_a, a), (model_b, b)), step)
        _check_step(model_a, a, model_b, b, f"int8, step {step}")
        for (pa, sa), (pb, sb) in zip(a.optim.state.items(), b.optim.state.items(), strict=True):
            assert pa.shape == pb.shape
            if isinstance(sa["exp_avg"], CompactTensor):
                assert isinstance(sb["exp_avg"], CompactTensor)
                assert torch.equal(sa["exp_avg"].codes, sb["exp_avg"].codes)
                assert torch.equal(sa["exp_avg_sq"].codes, sb["exp_avg_sq"].codes)
        _resync(model_a, a, model_b, b)
    assert any(isinstance(st["exp_avg"], CompactTensor) for st in b.optim.state.values())


@world(2)
def test_the_overlap_hook_steps_remainders_as_zero1() -> None:
    """shardkit-overlap steps bucket by bucket inside backward (``step_local(params)``): the
    same params and masters as ZeRO-1's own step."""
    from shardkit.overlap import register_zero_overlap

    model_a, model_b = _model(big=True), _model(big=True)
    ddp_a, ddp_b = DDP(model_a), DDP(model_b, bucket_cap_mb=0.02)
    a, b = _opt(model_a, "adamw", True), _opt(model_b, "adamw", True)
    register_zero_overlap(ddp_b, b)
    for step in range(3):
        _step_each(((ddp_a, a), (ddp_b, b)), step)
        for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
            assert torch.equal(pa, pb), f"step {step}"
        ma, mb = _masters(a, model_a), _masters(b, model_b)
        assert all(torch.equal(ma[k], mb[k]) for k in ma)


@world(2)
def test_dicts_load_both_ways_and_a_reload_continues_exactly() -> None:
    model_a, model_b = _model(), _model()
    a, b = _opt(model_a, "adamw", False), _opt(model_b, "adamw", True)
    for step in range(3):
        _step_each(((model_a, a), (model_b, b)), step)
    # an fp32-master dict into a fresh remainder optimizer: split once, exact
    sa = a.state_dict(all_ranks=True)
    model_c = _model()
    model_c.load_state_dict(model_a.state_dict())  # the model first, then the optimizer
    c = _opt(model_c, "adamw", True)
    c.load_state_dict(sa)
    mc, ma = _masters(c, model_c), _masters(a, model_a)
    for name, p in model_c.named_parameters():
        assert torch.equal(mc[name], ma[name]), name
        assert torch.equal(p, split_master(ma[name])[0]), name
    # a remainder dict reloaded at world 1 continues bit for bit with the uninterrupted run
    sb = b.state_dict(all_ranks=True)
    solo = dist.new_group([dist.get_rank()])
    model_d = _model()
    model_d.load_state_dict(model_b.state_dict())
    d = ShardedOptimizer(
        _groups(model_d), torch.optim.AdamW, group=solo, master_dtype=torch.float32,
        master_remainder=True, **_OPTIMS["adamw"][1],
    )  # fmt: skip
    d.load_state_dict(sb)
    for step in range(3, 5):
        _step_each(((model_b, b), (model_d, d)), step)
        for pb, pd in zip(model_b.parameters(), model_d.parameters(), strict=True):
            assert torch.equal(pb, pd), f"step {step}"
    md = d.master_model_state_dict(model_d, recipient_rank=0)
    mb = _masters(b, model_b)
    assert md is not None and all(torch.equal(md[k], mb[k]) for k in mb)


# ---------------------------------------------------------------------------- checkpoints

_K, _J = 3, 2


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("remainder_ckpt")


def _train(model: nn.Module, opt: ShardedOptimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


@world(2)
def test_save_world2(ckpt_root: Path) -> None:
    model = _model()
    opt = _opt(model, "adamw", True, master_grad_bucket_bytes=256)
    _train(model, opt, _K)
    save_run(model, opt, ckpt_root / "w2")


@world(1)
def test_load_2_to_1_continues_bit_for_bit(ckpt_root: Path) -> None:
    ref = _model()
    ref_opt = _opt(ref, "adamw", True)
    _train(ref, ref_opt, _K + _J)
    model = _model()
    model.load_state_dict(torch.load(ckpt_root / "w2.model.pt"))
    opt = _opt(model, "adamw", True)
    load_sharded(opt, ckpt_root / "w2")
    _train(model, opt, _J, start=_K)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    got, want = _masters(opt, model), _masters(ref_opt, ref)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the same checkpoint into an fp32-master optimizer: the exact masters
    model32 = _model()
    model32.load_state_dict(torch.load(ckpt_root / "w2.model.pt"))
    opt32 = _opt(model32, "adamw", False)
    load_sharded(opt32, ckpt_root / "w2")
    model_k = _model()
    opt_k = _opt(model_k, "adamw", True)
    _train(model_k, opt_k, _K)
    m32, mk = _masters(opt32, model32), _masters(opt_k, model_k)
    assert all(torch.equal(m32[k], mk[k]) for k in mk)


# ---------------------------------------------------------------------------- written params


@world(2)
def test_a_param_written_outside_the_optimizer_is_reseeded() -> None:
    """[Note: Params written outside the optimizer] with remainders: the master of a written
    param is the written value exactly (remainder 0), as the fp32-master run re-seeds it; a
    write of the same values resets the remainders too (documented)."""
    model_a, model_b = _model(), _model()
    a, b = _opt(model_a, "adamw", False), _opt(model_b, "adamw", True)

    def step_both(step: int) -> None:
        _step_each(((model_a, a), (model_b, b)), step)
        _check_step(model_a, a, model_b, b, f"step {step}")
        _resync(model_a, a, model_b, b)

    step_both(0)
    with torch.no_grad():  # new values: both runs re-seed from them
        for model in (model_a, model_b):
            model[0].weight.mul_(0.5)
            model[5].bias.add_(1.0)
    step_both(1)
    before = _masters(b, model_b)
    model_b.load_state_dict(model_b.state_dict())  # the same values, after the optimizer
    # what B must do: its masters become the params; A is told so explicitly
    a.load_master_model_state_dict(model_a, {n: p.float() for n, p in model_a.named_parameters()})
    assert any(not torch.equal(before[n], p.float()) for n, p in model_b.named_parameters())
    step_both(2)
    step_both(3)


@world(2)
def test_misuse_is_refused_clearly() -> None:
    model = _model()
    with pytest.raises(TypeError, match="master_remainder must be a bool"):
        ShardedOptimizer(model.parameters(), master_dtype=torch.float32, master_remainder=1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"needs master_dtype=torch\.float32, got master_dtype=None"
    ):
        ShardedOptimizer(model.parameters(), master_remainder=True)
    with pytest.raises(ValueError, match=r"got master_dtype=torch\.float64"):
        ShardedOptimizer(model.parameters(), master_dtype=torch.float64, master_remainder=True)
    with pytest.raises(ValueError, match="master_remainder"):  # ranks must agree
        ShardedOptimizer(
            model.parameters(), master_dtype=torch.float32,
            master_remainder=dist.get_rank() == 0,
        )  # fmt: skip


# ---------------------------------------------------------------------------- memory


@world(2)
def test_masters_hold_two_bytes_per_bf16_param() -> None:
    """Live storages: the remainder run holds 2 bytes per owned bf16 param less than the fp32
    master run, besides its chunk of joined masters; the masters themselves are 2 bytes."""
    held: dict[bool, int] = {}
    owned = 0
    scratch = 0
    for remainder in (False, True):
        model = _model(big=True)
        _loss(model, 0).backward()
        grads = [p.grad for p in model.parameters()]
        before = live_storages(extra=grads)
        opt = ShardedOptimizer(
            model.parameters(), torch.optim.SGD, lr=0.1, master_dtype=torch.float32,
            master_remainder=remainder, master_grad_bucket_bytes=4096,
        )  # fmt: skip
        opt.step()
        after = live_storages(extra=grads)
        held[remainder] = sum(after.values()) - sum(before.values())  # net: params moved
        if remainder:
            masters = opt._local.masters
            assert isinstance(masters, MasterSet) and masters.remainder
            owned = sum(p.numel() for p in opt.owned_params)
            nbytes = masters.nbytes()
            assert nbytes["remainders"] == 2 * owned and nbytes["masters"] == 0
            # the handles the wrapped optimizer steps share one 4-byte storage per device
            handles = [h for g in opt.optim.param_groups for h in g["params"]]
            assert {h.untyped_storage().nbytes() for h in handles} == {4}
            assert len({h.untyped_storage().data_ptr() for h in handles}) == 1
            largest = max(p.numel() for p in opt.owned_params)
            scratch = 4 * largest + 4  # the joined masters' chunk and the handles' element
        del opt, model, grads
    assert held[False] - held[True] == 2 * owned - scratch, (held, owned, scratch)


@world(2)
def test_a_repartition_moves_the_exact_masters() -> None:
    """set_partition / refresh_trainable carry each master joined (fp32) to its new owner,
    which splits it again: the run continues as one that never moved."""
    model_a, model_b = _model(), _model()
    a, b = _opt(model_a, "adamw", True), _opt(model_b, "adamw", True)
    _train(model_a, a, 2)
    _train(model_b, b, 2)
    n = len(b.shard_layout.params)
    b.set_partition([0] * n)
    b.set_partition([(i + 1) % 2 for i in range(n)])
    _train(model_a, a, 2, start=2)
    _train(model_b, b, 2, start=2)
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    ma, mb = _masters(a, model_a), _masters(b, model_b)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
