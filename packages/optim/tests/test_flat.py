"""ZeRO-2's half of the engine: flat owner-contiguous buckets and the local step of a shard.

Single-process math: every rank of a world is simulated in one process (each with its own copy
of the params and its own buckets), so the properties run over shapes, world sizes and
optimizers without a process group. The state dicts are collective and run over Gloo.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardkit.optim import (
    ELEMENTWISE_OPTIMIZERS,
    FlatBucket,
    ParkedState,
    ShardStepper,
    build_flat_buckets,
    checkpoint_part,
    gather_full_state_dict,
    is_elementwise,
    load_full_state_dict,
)
from shardkit.testing import world
from torch import nn

_SHAPES = [(), (1,), (0,), (1, 1), (3,), (2, 3), (7,), (2, 0, 3), (5, 4), (13,)]
_OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}
_SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def _params(shapes: list[tuple[int, ...]], seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _build(
    params: list[nn.Parameter], world_size: int, elementwise: bool, cap: int
) -> list[FlatBucket]:
    buckets, prints = build_flat_buckets(
        [{"params": params}], [elementwise], world_size, cap_bytes=cap, first_cap_bytes=cap
    )
    assert len(prints) == 1
    return buckets


@pytest.mark.parametrize("compact", [None, "int8"])
def test_flat_buffers_share_one_allocation_off_the_cpu(compact: str | None) -> None:
    """[Note: Flat buffers in one allocation]: off the CPU (``meta`` stands in for CUDA here),
    every bucket of a dtype is a view of one allocation, starting at a multiple of 64
    elements, the views disjoint and in bucket order, the params views of their bucket; on a
    CPU each bucket has a storage of its own (``share_memory()`` moves whole storages)."""
    shapes = [(2048, 2048), (2048,), (5, 3), (), (0,), (1000, 3), (7,)]
    for device in ("meta", "cpu"):
        params = [nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
        params.append(nn.Parameter(torch.zeros(9, dtype=torch.float64, device=device)))
        buckets, _ = build_flat_buckets(
            [{"params": params}],
            [True],
            3,
            cap_bytes=1 << 20,
            first_cap_bytes=1 << 20,
            compact_state=compact,
        )
        assert len(buckets) >= 3
        for b in buckets:
            for p, off in zip(b.params, b.offsets, strict=True):
                assert p.untyped_storage().nbytes() == b.flat.untyped_storage().nbytes()
                assert p.storage_offset() == b.flat.storage_offset() + off
        if device == "cpu":
            assert all(b.flat.storage_offset() == 0 for b in buckets)
            assert all(
                b.flat.untyped_storage().nbytes() == b.numel * b.flat.element_size()
                for b in buckets
            )
            continue
        for dtype in (torch.float32, torch.float64):
            mine = [b for b in buckets if b.dtype is dtype]
            total = sum(-(-b.numel // 64) * 64 for b in mine)
            end = 0
            for b in mine:
                assert b.flat.untyped_storage().nbytes() == total * b.flat.element_size()
                assert b.flat.storage_offset() % 64 == 0 and b.flat.storage_offset() >= end
                end = b.flat.storage_offset() + b.numel


def test_elementwise_classes() -> None:
    assert is_elementwise(torch.optim.AdamW)
    assert not is_elementwise(type("Muon", (torch.optim.SGD,), {}))  # subclasses may not be
    assert is_elementwise(torch.optim.LBFGS, True)
    assert not is_elementwise(torch.optim.Adam, False)
    assert torch.optim.SGD in ELEMENTWISE_OPTIMIZERS


@_SETTINGS
@given(
    shapes=st.lists(st.sampled_from(_SHAPES), min_size=1, max_size=6),
    world_size=st.integers(1, 5),
    elementwise=st.booleans(),
    cap=st.sampled_from([4, 40, 1 << 20]),
)
def test_every_element_has_exactly_one_owner(
    shapes: list[tuple[int, ...]], world_size: int, elementwise: bool, cap: int
) -> None:
    params = _params(shapes, 0)
    before = [p.detach().clone() for p in params]
    buckets = _build(params, world_size, elementwise, cap)
    laid = [p for b in buckets for p in b.params]
    assert sorted(map(id, laid)) == sorted(map(id, params))  # each param in one bucket
    for p, want in zip(params, before, strict=True):
        assert torch.equal(p.detach(), want)  # values kept
    for b in buckets:
        assert b.numel == b.flat.numel() == b.shard * world_size
        for p, off in zip(b.params, b.offsets, strict=True):
            # a view of the flat buffer at its offset
            assert p.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
            assert p.storage_offset() == b.flat.storage_offset() + off
        covered = [0] * b.numel
        if b.elementwise:
            assert b.numel - sum(p.numel() for p in b.params) < world_size  # padding < N
            homes = {i: 0 for i, p in enumerate(b.params) if p.numel() == 0}
            for r in range(world_size):
                start, end = b.range_of(r)
                for i, lo, hi in b.pieces(r):
                    off, n = b.offsets[i], b.params[i].numel()
                    assert off <= lo <= hi <= off + n and start <= lo and hi <= end
                    for k in range(lo, hi):
                        covered[k] += 1
                    if n == 0:
                        homes[i] += 1
            assert all(v == 1 for v in homes.values())  # an empty param has one home
        else:
            for r in range(world_size):
                start, end = b.range_of(r)
                assert b.shard_view(r).data_ptr() == b.flat[start:].data_ptr()
                for i, p in b.owned_params(r):
                    assert start <= b.offsets[i] and b.offsets[i] + p.numel() <= end
                    for k in range(b.offsets[i], b.offsets[i] + p.numel()):
                        covered[k] += 1
            assert sorted(i for r in range(world_size) for i, _ in b.owned_params(r)) == list(
                range(len(b.params))
            )
        for p, off in zip(b.params, b.offsets, strict=True):
            assert covered[off : off + p.numel()] == [1] * p.numel()


def _grads(params: list[nn.Parameter], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def _hand_grads(b: FlatBucket, grads: dict[int, torch.Tensor], rank: int) -> None:
    """What a driver's reduce-scatter leaves: this rank's range of the bucket's full gradient."""
    full = torch.zeros(b.numel)
    for p, off in zip(b.params, b.offsets, strict=True):
        if id(p) in grads:
            full[off : off + p.numel()] = grads[id(p)].reshape(-1)
    start, end = b.range_of(rank)
    b.grad_shard = full[start:end].clone()
    b.grad_fresh = False


@_SETTINGS
@given(
    shapes=st.lists(st.sampled_from(_SHAPES), min_size=1, max_size=5),
    world_size=st.integers(1, 4),
    name=st.sampled_from(sorted(_OPTIMS)),
    elementwise=st.booleans(),
    unused=st.integers(0, 4),
)
def test_ranks_stepping_their_shards_equal_a_plain_optimizer(
    shapes: list[tuple[int, ...]], world_size: int, name: str, elementwise: bool, unused: int
) -> None:
    """Every rank steps its shard; put back together, the params equal a plain optimizer's
    bit for bit, over 3 steps, with one param unused in the last (skipped, as a plain
    optimizer skips a param whose ``.grad`` is ``None``)."""
    cls, kwargs = _OPTIMS[name]
    ref = _params(shapes, 1)
    ref_opt = cls(ref, **kwargs)
    ranks = []
    for r in range(world_size):
        mine = _params(shapes, 1)
        groups = [{"params": mine, **kwargs}]
        buckets = _build(mine, world_size, elementwise, 24)
        ranks.append((mine, buckets, groups, ShardStepper(buckets, cls, groups, {}, r, None)))
    skip = unused % len(shapes)
    for step in range(3):
        grads = _grads(ref, 10 + step)
        for i, (p, g) in enumerate(zip(ref, grads, strict=True)):
            p.grad = None if step == 2 and i == skip else g.clone()
        ref_opt.step()
        for r, (mine, buckets, groups, stepper) in enumerate(ranks):
            live = {
                id(p): g
                for i, (p, g) in enumerate(zip(mine, grads, strict=True))
                if not (step == 2 and i == skip)
            }
            for b in buckets:
                _hand_grads(b, live, r)
            idle = {
                (b.index, pos) for b in buckets for pos, p in enumerate(b.params) if id(p) not in live
            }
            stepper.step(idle)
    for k, want in enumerate(ref):
        # rank r's copy holds the truth for the elements it owns
        got = torch.empty(want.numel())
        for r, (mine, buckets, _, _) in enumerate(ranks):
            b = next(b for b in buckets if any(p is mine[k] for p in b.params))
            pos = next(i for i, p in enumerate(b.params) if p is mine[k])
            start, end = b.range_of(r)
            off = b.offsets[pos]
            lo, hi = max(start, off), min(end, off + want.numel())
            if hi > lo:
                got[lo - off : hi - off] = b.flat[lo:hi]
        assert torch.equal(got.view(want.shape), want.detach()), (name, k)


def test_master_copies_step_in_fp32_and_cast_back() -> None:
    """bf16 params with fp32 masters: the same update as fp32 params, rounded once."""
    ref = nn.Parameter(torch.randn(6, 5))
    opt = torch.optim.AdamW([ref], lr=0.01)
    p = nn.Parameter(ref.detach().to(torch.bfloat16))
    groups = [{"params": [p], "lr": 0.01}]
    buckets = _build([p], 1, True, 1 << 20)
    master = ref.detach().clone()  # the master starts from the live fp32 values
    stepper = ShardStepper(buckets, torch.optim.AdamW, groups, {}, 0, torch.float32)
    (entry,) = stepper.all_entries()
    assert entry.master is not None and entry.master.dtype == torch.float32
    entry.master.copy_(master.reshape(-1))
    g = torch.randn(6, 5)
    ref.grad = g
    opt.step()
    _hand_grads(buckets[0], {id(p): g.to(torch.bfloat16)}, 0)
    ref2 = ref.detach().clone()
    ref2.copy_(master)
    ref2.grad = g.to(torch.bfloat16).float()
    opt2 = torch.optim.AdamW([ref2], lr=0.01)
    opt2.step()
    stepper.step()
    assert torch.equal(entry.master.view(6, 5), ref2.detach())
    assert torch.equal(p.detach(), ref2.detach().to(torch.bfloat16))
    assert stepper.state_bytes() == 6 * 5 * 4 * 3 + 4  # master, exp_avg, exp_avg_sq, step


@world(2)
def test_full_state_dict_is_a_plain_optimizers_and_loads_back() -> None:
    rank = dist.get_rank()
    shapes = [(5, 3), (), (7,), (1,), (0,)]
    ref = _params(shapes, 3)
    ref_opt = torch.optim.Adam(ref, lr=0.01)
    mine = _params(shapes, 3)
    groups = [{"params": mine, "lr": 0.01}]
    buckets = _build(mine, 2, True, 32)
    stepper = ShardStepper(buckets, torch.optim.Adam, groups, {}, rank, None)
    grads = _grads(ref, 4)
    for p, g in zip(ref, grads, strict=True):
        p.grad = g
    ref_opt.step()
    for b in buckets:
        _hand_grads(b, {id(p): g for p, g in zip(mine, grads, strict=True)}, rank)
    stepper.step()
    calls: list[int] = []

    def counted(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> object:
        calls.append(out.numel())
        dist.all_gather(list(out.chunk(2)), inp, group=group)
        return None

    group = dist.group.WORLD
    assert group is not None
    full = gather_full_state_dict(stepper, buckets, groups, group, all_gather=counted)
    want = ref_opt.state_dict()
    assert calls, "the per-element state travels through the given all-gather"
    assert full["param_groups"] == want["param_groups"]
    assert full["state"].keys() == want["state"].keys()
    for i, st_ in want["state"].items():
        for k, v in st_.items():
            assert torch.equal(full["state"][i][k], v), (i, k)
    parts = [checkpoint_part(full, r, 2) for r in range(2)]
    assert sorted(i for part in parts for i in part["state"]) == sorted(full["state"])

    # load into a fresh layout and read it back: the same dict
    fresh = _params(shapes, 5)
    groups2 = [{"params": fresh, "lr": 0.5}]
    buckets2 = _build(fresh, 2, True, 32)
    stepper2 = ShardStepper(buckets2, torch.optim.Adam, groups2, {}, rank, None)
    parked = load_full_state_dict(stepper2, buckets2, groups2, copy.deepcopy(full))
    assert parked == ParkedState({}, {})
    assert groups2[0]["lr"] == 0.01
    again = gather_full_state_dict(stepper2, buckets2, groups2, group)
    for i, st_ in full["state"].items():
        for k, v in st_.items():
            assert torch.equal(again["state"][i][k], v), (i, k)

    with pytest.raises(ValueError, match="param groups of sizes"):
        load_full_state_dict(stepper2, buckets2, groups2, {"state": {}, "param_groups": []})


def test_a_driver_sets_a_bucket_and_a_stepper_through_their_methods() -> None:
    """``attach_grad_shard`` checks what it is given; ``mark_reduced`` / ``mark_consumed``
    decide whether the stepper steps the shard; ``drop_factors`` forgets the queued factors."""
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(5))]
    (b,), _ = build_flat_buckets([{"params": params}], [True], 2, 1 << 20, 1 << 20)
    with pytest.raises(ValueError, match=f"must have {b.shard} elements"):
        b.attach_grad_shard(torch.zeros(b.shard + 1))
    with pytest.raises(ValueError, match="must have"):
        b.attach_grad_shard(torch.zeros(b.shard, dtype=torch.float64))
    b.attach_grad_shard(torch.ones(b.shard))
    stepper = ShardStepper([b], torch.optim.SGD, [{"params": params, "lr": 1.0}], {"lr": 1.0}, 0, None)
    before = b.flat.clone()
    stepper.step()  # fresh: not stepped
    assert torch.equal(b.flat, before)
    b.mark_reduced()
    assert not b.grad_fresh
    stepper.step()
    assert torch.equal(b.flat[: b.shard], before[: b.shard] - 1.0)
    b.mark_consumed()
    assert b.grad_fresh
    stepper.factors.add(torch.tensor(0.5))
    assert len(stepper.factors) == 1
    stepper.drop_factors()
    assert len(stepper.factors) == 0
