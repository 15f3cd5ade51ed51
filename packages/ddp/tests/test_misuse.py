"""Misuse fails cleanly on every rank (issue 29): a clear error naming the calls the ranks
disagreed on, within ``collective_timeout``, no process killed, nothing moved."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn

TIMEOUT_S = 10.0  # well above a loaded machine's agreement latency


def _mlp(extra_buffer: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8, track_running_stats=extra_buffer)
    return nn.Sequential(nn.Linear(4, 8), norm, nn.Tanh(), nn.Linear(8, 2))


def _wrapped(**kw: object) -> tuple[nn.Module, ShardedOptimizer, ShardedDataParallel]:
    m = _mlp()
    opt = ShardedOptimizer(
        m.parameters(), optim=torch.optim.Adam, lr=1e-2, collective_timeout=TIMEOUT_S
    )
    return m, opt, ShardedDataParallel(m, opt, reduce_buffer_size=64, **kw)  # type: ignore[arg-type]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return model(torch.randn(6, 4, generator=g)).square().mean()


def _snapshot(m: nn.Module) -> list[torch.Tensor]:
    # state_dict() waits for the param gathers of the last step (overlap_param_gather)
    return [v.detach().clone() for v in m.state_dict().values()]


def _unchanged(before: list[torch.Tensor], m: nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, _snapshot(m), strict=True))


@world(2)
def test_a_buffer_on_one_rank_only_is_refused_at_construction_naming_it() -> None:
    m = _mlp(extra_buffer=dist.get_rank() == 1)  # rank 1: BatchNorm running stats
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"First difference.*buffer '1\.running_mean'"):
        ShardedDataParallel(m, opt)
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank raised, nobody was killed, the group still works
    assert t.item() == 2


@world(2)
def test_a_param_of_another_shape_is_refused_at_construction_naming_it() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2 + dist.get_rank()))
    with pytest.raises(ValueError):  # check_consistent (the optimizer's own check) or ours
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
        ShardedDataParallel(m, opt)


@world(2, timeout=120)
def test_one_rank_without_backward_raises_on_every_rank() -> None:
    m, opt, sdp = _wrapped(broadcast_buffers=False)
    _loss(sdp, 0).backward()
    opt.step()
    before = _snapshot(m)
    start = time.monotonic()
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match=r"different collective calls.*backward.*step"):
            _loss(sdp, 1).backward()
    else:
        _loss(sdp, 1)  # forward only: no backward on this rank
        with pytest.raises(RuntimeError, match=r"different collective calls.*backward.*step"):
            opt.step()
    assert time.monotonic() - start < 40
    assert _unchanged(before, m)


@world(2, timeout=120)
def test_no_sync_on_one_rank_raises_on_every_rank() -> None:
    m, _opt, sdp = _wrapped(broadcast_buffers=False)
    before = _snapshot(m)
    if dist.get_rank() == 0:
        with sdp.no_sync():
            _loss(sdp, 0).backward()
    with pytest.raises(RuntimeError, match=r"no_sync\(\)"):
        _loss(sdp, 1).backward()  # rank 0: after one no_sync() backward; rank 1: none
    assert _unchanged(before, m)


@world(2, timeout=120)
def test_state_dict_on_one_rank_while_the_other_trains_raises_on_both() -> None:
    _m, opt, sdp = _wrapped(broadcast_buffers=False)
    _loss(sdp, 0).backward()
    opt.step()
    start = time.monotonic()
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match=r"different collective calls|waited"):
            opt.state_dict(all_ranks=True)
    else:
        with pytest.raises(RuntimeError, match=r"different collective calls|waited"):
            _loss(sdp, 1).backward()
    assert time.monotonic() - start < 40


@world(2, timeout=120)
def test_optimizer_state_dict_on_one_rank_alone_raises_within_the_timeout() -> None:
    _m, opt, sdp = _wrapped(broadcast_buffers=False)
    _loss(sdp, 0).backward()
    opt.step()
    if dist.get_rank() == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"optimizer_state_dict\(\) and waited"):
            sdp.optimizer_state_dict()
        assert time.monotonic() - start < 40
    else:
        time.sleep(TIMEOUT_S + 1)
        with pytest.raises(RuntimeError, match=r"different collective calls"):
            opt.step()  # its next collective call learns of it


@world(2, timeout=120)
def test_a_per_rank_learning_rate_is_refused_before_anything_moves() -> None:
    """(ZeRO-1 and the overlap hook: shardkit-overlap's tests/test_errors.py.)"""
    m = _mlp()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    model = ShardedDataParallel(m, opt, broadcast_buffers=False)
    _loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    _loss(model, 1).backward()
    before = _snapshot(m)
    opt.param_groups[0]["lr"] = 0.1 * (1 + dist.get_rank())  # a per-rank schedule
    with pytest.raises(ValueError, match="different hyper-parameters"):
        opt.step()
    assert _unchanged(before, m)


@world(2)
def test_zero1_only_calls_raise_clearly_under_the_wrapper_and_leave_it_usable() -> None:
    """What only whole-param ZeRO-1 does (per-param skip, filter, local steps, syncs, master
    import, repartitions) raises, or does not exist, on every rank under ShardedDataParallel."""
    m, opt, ddp = _wrapped()
    _loss(ddp, 0).backward()
    with pytest.raises(ValueError, match="clip_grad_norm.filter_params_fn.* not supported"):
        opt.clip_grad_norm(1.0, filter_params_fn=lambda ps: ps)
    with pytest.raises(ValueError, match=r"skip=.* not supported under ShardedDataParallel"):
        opt.consolidate_state_dict(skip=lambda p: p.dim() == 1)
    # See [Note: Members of one mode] in shardkit.optim._driver: ZeRO-1's members do not exist
    for name in (
        "optim",
        "step_local",
        "sync_params",
        "set_partition",
        "refresh_trainable",
        "add_param_group",
        "load_master_model_state_dict",
    ):
        assert not hasattr(opt, name), name
        with pytest.raises(AttributeError, match=rf"no '{name}' while shardkit.ddp.Sharded"):
            getattr(opt, name)
    with pytest.raises(AttributeError, match=r"call the wrapper's refresh_trainable\(\)"):
        opt.refresh_trainable()
    before = _snapshot(m)
    opt.step()  # still usable: the refused calls moved nothing
    assert not _unchanged(before, m)
    opt.consolidate_state_dict(recipient_rank=0)
    assert opt.state_dict()["param_groups"][0]["lr"] == 1e-2


@world(2)
def test_a_graph_left_in_grad_by_no_sync_is_refused_at_the_next_forward() -> None:
    """``create_graph=True`` under ``no_sync()`` leaves a ``.grad`` that requires grad; ZeRO-2
    reduces detached gradients, so the next training forward raises on every rank, before any
    collective; a synchronised ``create_graph=True`` backward (reduced at once) trains on."""
    m, opt, sdp = _wrapped()
    _loss(sdp, 0).backward(create_graph=True)  # synchronised: staged detached, no graph left
    opt.step()
    opt.zero_grad()
    with sdp.no_sync():
        _loss(sdp, 1).backward(create_graph=True)
    with pytest.raises(RuntimeError, match=r"\.grad that requires grad .*higher-order"):
        _loss(sdp, 2)
    sdp.eval()
    with torch.no_grad():
        _loss(sdp, 2)  # evaluation is not refused
    sdp.train()
    opt.zero_grad()
    _loss(sdp, 2).backward()
    opt.step()
