"""Param idioms around ``step()`` that replace or move a param's storage, against torch DDP.

``p.data = t``, a dtype round trip, ``vector_to_parameters`` (see shardkit-optim's [Note:
Params that left their bucket]), ``share_memory()`` (the guard's spans follow the buckets:
[Note: Param access guard]), and ``optimizer.state`` under ZeRO-2. Each runs at world 2 over
Gloo with AdamW (foreach), several bucket sizes, both param-gather modes, and compares the
params after the loop with DDP + AdamW bit for bit (a sum of two values does not depend on the
order, and both scale by 1/2: the same bits).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ParamStorageError, ShardedOptimizer
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _set_data(m: nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.data = p.data * 0.5 + 0.01


def _round_trip(m: nn.Module) -> None:
    m.double()
    m.float()


def _vector(m: nn.Module) -> None:
    vec = nn.utils.parameters_to_vector(m.parameters())
    nn.utils.vector_to_parameters(vec * 0.9, m.parameters())


def _clone(m: nn.Module) -> None:
    for p in m.parameters():
        p.data = p.data.clone()


def _set_(m: nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.set_(p.detach().clone() + 0.001)


def _half_round_trip(m: nn.Module) -> None:
    m.half()
    m.float()


def _share(m: nn.Module) -> None:
    m.share_memory()


def _read_after(m: nn.Module) -> None:
    pass


_IDIOMS: dict[str, Callable[[nn.Module], None]] = {
    "set_data": _set_data,
    "round_trip": _round_trip,
    "vector_to_parameters": _vector,
    "clone": _clone,
    "set_": _set_,
    "half_round_trip": _half_round_trip,
    "share_memory": _share,
}


class _AllReduce(nn.Module):
    """DDP's arithmetic by hand (grads halved, then summed: DDP's bits). The reference for
    the dtype round trips and ``p.set_(t)``, after which torch DDP itself stops averaging the
    new storage's gradients (its reducer keeps the old ones: measured on torch 2.13, 9e-3 to
    2e-2 after one step)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(_all_reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)  # type: ignore[no-any-return]


def _all_reduce(p: torch.Tensor) -> None:
    assert p.grad is not None
    p.grad.div_(dist.get_world_size())
    dist.all_reduce(p.grad)


def _train(
    idiom: str, where: str, bucket: int | None, overlap: bool, views: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    by_hand = idiom in ("round_trip", "half_round_trip", "set_")
    ref: nn.Module = _AllReduce(ref_m) if by_hand else DDP(ref_m)
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(
        m,
        opt,
        reduce_buffer_size=bucket,
        overlap_param_gather=overlap,
        gradient_as_bucket_view=views,
    )
    act = _IDIOMS[idiom]
    for step in range(5):
        x, y = _batch(step)
        for model, o, mod in ((ref, ref_opt, ref_m), (sdp, opt, m)):
            if step == 2 and where == "before_forward":
                act(mod)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if step == 2 and where == "before_step":
                act(mod)
            o.step()
            if step in (1, 3) and where == "after_step":
                act(mod)  # with the gathers pending
            o.zero_grad()
    # what the user reads: every param (through the guard) and the next forward's output
    x, _ = _batch(9)
    with torch.no_grad():
        outs = [ref(x), sdp(x)]
    return [p.detach().clone() for p in ref_m.parameters()] + [outs[0]], [
        p.detach().clone() for p in m.parameters()
    ] + [outs[1]]


@pytest.mark.parametrize("idiom", sorted(_IDIOMS))
@pytest.mark.parametrize("where", ["after_step", "before_forward", "before_step"])
@pytest.mark.parametrize("bucket", [0, 40, None])
@world(2)
def test_replaced_storage_keeps_training_as_ddp(idiom: str, where: str, bucket: int | None) -> None:
    """DDP keeps training after the idiom; so does ShardedDataParallel, bit for bit. One
    stated exception: ``model.half(); model.float()`` between backward and ``step()`` rounds
    DDP's full ``.grad`` through fp16 too, while ZeRO-2's reduced gradient waits in the shard
    (``.grad`` is a placeholder) and keeps its fp32 bits: within 1e-5 (measured 4e-6)."""
    ref, got = _train(idiom, where, bucket, overlap=True)
    atol = 1e-5 if (idiom, where) == ("half_round_trip", "before_step") else 0.0
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=atol)


@pytest.mark.parametrize("idiom", ["set_data", "round_trip", "vector_to_parameters"])
@pytest.mark.parametrize("views", [False, True])
@world(2)
def test_replaced_storage_without_overlap(idiom: str, views: bool) -> None:
    """The same without deferred gathers, and with gradients as bucket views."""
    ref, got = _train(idiom, "after_step", 40, overlap=False, views=views)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@world(2)
def test_replaced_storage_keeps_the_optimizer_state_and_masters() -> None:
    """With bf16 params and fp32 masters the master takes the new value; Adam's moments stay."""
    torch.manual_seed(0)
    m = _model().to(torch.bfloat16)
    opt = ShardedOptimizer(
        m.parameters(), optim=torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32
    )
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=40)
    for step in range(3):
        x, y = _batch(step)
        nn.functional.mse_loss(sdp(x.bfloat16()), y.bfloat16()).backward()
        opt.step()
        opt.zero_grad()
    before = {k: int(v["step"]) for k, v in enumerate(opt.state.values())}
    assert before
    with torch.no_grad():
        for p in m.parameters():
            p.data = torch.full_like(p, 0.25)
    x, y = _batch(5)
    nn.functional.mse_loss(sdp(x.bfloat16()), y.bfloat16()).backward()
    opt.step()
    for k, v in enumerate(opt.state.values()):
        assert int(v["step"]) == before[k] + 1
    # every param moved from 0.25 by at most ~lr: the master took the new value
    for p in m.parameters():
        assert (p.float() - 0.25).abs().max() < 0.05


@world(2)
def test_a_param_whose_dtype_stays_changed_is_refused() -> None:
    """``model.double()`` alone would train in fp64 under DDP: refused on every rank by the
    step's agreement, before anything moves."""
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt)
    x, y = _batch(0)
    nn.functional.mse_loss(sdp(x), y).backward()
    opt.step()
    m.double()
    nn.functional.mse_loss(sdp(x.double()), y.double()).backward()
    with pytest.raises(RuntimeError, match="laid out as"):
        opt.step()


@pytest.mark.parametrize("auto_refresh", [True, False])
@world(2)
def test_new_parameter_objects_are_refused(auto_refresh: bool) -> None:
    """``load_state_dict(assign=True)`` puts new Parameter objects in the module, which the
    optimizer does not hold (DDP would not train them either): refused at the next training
    forward, on every rank, with what happened and the fix."""
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, auto_refresh_trainable=auto_refresh)
    x, y = _batch(0)
    nn.functional.mse_loss(sdp(x), y).backward()
    opt.step()
    opt.zero_grad()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(state, assign=True)
    with pytest.raises(ParamStorageError, match=r"new Parameter objects .*assign=True"):
        sdp(x)


def _numel(t: object) -> int:
    """Elements of a state tensor, plain or compact (codes and scales, as stored)."""
    return t.numel() if isinstance(t, torch.Tensor) else int(t.numel)  # type: ignore[attr-defined]


@pytest.mark.parametrize("bucket", [0, 40, None])
@pytest.mark.parametrize("compact", [None, "int8"])
@world(2)
def test_optimizer_state_shows_this_ranks_shard(bucket: int | None, compact: str | None) -> None:
    """``optimizer.state`` after a ZeRO-2 step: one entry per param with a piece here, whose
    tensors are the live state the next step updates; together the ranks hold every element
    of every param's state once (the consolidated dict's)."""
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2, compact_state=compact)
    assert not opt.state
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=bucket)
    for step in range(2):
        x, y = _batch(step)
        nn.functional.mse_loss(sdp(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert opt.state  # the flag of [Note: State truthiness]
    params = list(m.parameters())
    assert len(opt.state) > 0 and all(any(p is q for q in params) for p in opt.state)
    for p, st in opt.state.items():
        assert int(st["step"]) == 2
        assert p in opt.state
    for p in params:  # as ZeRO-1's defaultdict: a param with no piece here reads empty
        assert p in opt.state or opt.state[p] == {}
    mine = sum(_numel(st["exp_avg"]) for st in opt.state.values())
    total = torch.tensor([mine])
    dist.all_reduce(total)
    if compact is None:
        assert int(total) == sum(p.numel() for p in params)
        # live: the next step updates the tensors shown
        shown = {id(p): st["exp_avg"] for p, st in opt.state.items()}
        before = {k: v.clone() for k, v in shown.items()}
        x, y = _batch(3)
        nn.functional.mse_loss(sdp(x), y).backward()
        opt.step()
        assert any(not torch.equal(shown[k], before[k]) for k in shown)
        assert all(shown[id(p)] is st["exp_avg"] for p, st in opt.state.items())


@pytest.mark.parametrize("target", ["module", "wrapper"])
@world(2)
def test_a_compiled_eval_between_step_and_zero_grad_runs_as_under_ddp(target: str) -> None:
    """``torch.compile`` (AOT eager: no code generation on this box) of an eval between
    ``step()`` and ``zero_grad()``: the fake-tensor conversion reads every ``.grad``'s
    metadata, which the placeholders let through; the outputs equal DDP's bit for bit."""
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref = DDP(ref_m)
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=40)
    compiled_ref = torch.compile(ref_m, backend="aot_eager")
    compiled = torch.compile(m if target == "module" else sdp, backend="aot_eager")
    for step in range(3):
        x, y = _batch(step)
        for model, o in ((ref, ref_opt), (sdp, opt)):
            model.train()
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
        ref_m.eval()
        sdp.eval()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), compiled_ref(x), rtol=0, atol=0)
        ref_opt.zero_grad()
        opt.zero_grad()


@world(2)
def test_the_placeholder_error_says_what_to_do_for_the_op() -> None:
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt)
    x, y = _batch(0)
    nn.functional.mse_loss(sdp(x), y).backward()
    grad = next(m.parameters()).grad
    assert grad is not None
    with pytest.raises(RuntimeError, match=r"no_sync\(\).*optimizer\.zero_grad\(\) first"):
        grad.sum()
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(max_norm\)"):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("bucket", [0, 40, None])
@world(2)
def test_torch_func_after_step_reads_the_gathered_params(bucket: int | None) -> None:
    """``torch.func.grad_and_value`` over ``dict(model.named_parameters())`` right after
    ``step()`` (gathers in flight): the functorch wrappers are unwrapped to the params'
    storage, so the value and the gradients equal DDP's bit for bit."""
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref = DDP(ref_m)
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=bucket)
    for step in range(3):
        x, y = _batch(step)
        got = []
        for model, o, mod in ((ref, ref_opt, ref_m), (sdp, opt, m)):
            nn.functional.mse_loss(model(x), y).backward()
            o.step()

            def loss(
                params: dict[str, torch.Tensor], x: torch.Tensor = x, y: torch.Tensor = y
            ) -> torch.Tensor:
                h = torch.tanh(nn.functional.linear(x, params["0.weight"], params["0.bias"]))
                h = torch.tanh(nn.functional.linear(h, params["2.weight"], params["2.bias"]))
                out = nn.functional.linear(h, params["4.weight"], params["4.bias"])
                return nn.functional.mse_loss(out, y)

            named = dict(mod.named_parameters())
            got.append(torch.func.grad_and_value(loss)(named))
            o.zero_grad()
        (ref_g, ref_v), (g, v) = got
        torch.testing.assert_close(v, ref_v, rtol=0, atol=0)
        for k in ref_g:
            torch.testing.assert_close(g[k], ref_g[k], rtol=0, atol=0)
