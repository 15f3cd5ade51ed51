"""Copy-on-write consolidation: the recipient's own shard is aliased, yet the dict is a snapshot."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer, _cow
from shardkit.optim._torch_compat import _storage_use_count
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def test_storage_use_count_pin() -> None:
    """Pins ``torch._C._storage_Use_Count`` as ``_torch_compat._storage_use_count`` reads it."""
    a = torch.zeros(100)
    base = _storage_use_count(a)
    assert base is not None
    v = a.view(10, 10)
    w = v[0:3]
    assert _storage_use_count(a) == base + 2
    del v
    assert _storage_use_count(a) == base + 1
    del w
    assert _storage_use_count(a) == base
    b = a.clone()
    assert _storage_use_count(a) == base and _storage_use_count(b) == base


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )


class _Pair:
    """ShardedOptimizer(Adam) under DDP and the DDP + plain Adam reference, stepped together."""

    def __init__(self) -> None:
        ref_model = _model()
        self.model = copy.deepcopy(ref_model)
        self.ref_model = ref_model
        self.ref, self.ddp = DDP(ref_model), DDP(self.model)
        self.ref_opt = torch.optim.Adam(ref_model.parameters(), lr=0.01)
        self.opt = ShardedOptimizer(self.model.parameters(), optim=torch.optim.Adam, lr=0.01)
        self.steps = 0

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            g = torch.Generator().manual_seed(100 * self.steps + dist.get_rank())
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
            for net, o in ((self.ref, self.ref_opt), (self.ddp, self.opt)):
                o.zero_grad()
                nn.functional.mse_loss(net(x), y).backward()
                o.step()
            self.steps += 1

    def assert_in_step(self) -> None:
        for a, b in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
            assert torch.equal(a, b)

    def live(self) -> dict[int, dict[str, torch.Tensor]]:
        """This rank's live state tensors by global index."""
        params = list(self.model.parameters())
        return {
            i: dict(self.opt.optim.state[p])
            for i, p in enumerate(params)
            if p in self.opt.optim.state
        }


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _assert_sd_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["state"].keys() == b["state"].keys()
    for i, st in a["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["state"][i][k]), (i, k)


@pytest.mark.parametrize("recipient", [0, 1])
@world(2)
def test_own_shard_is_aliased_and_the_dict_stays_a_snapshot(recipient: int) -> None:
    pair = _Pair()
    pair.step(2)
    pair.opt.consolidate_state_dict(recipient)
    if dist.get_rank() == recipient:
        sd = pair.opt.state_dict()
        live = pair.live()
        assert live, "this rank owns some params"
        for i, st in live.items():
            for k, t in st.items():
                assert _same_storage(sd["state"][i][k], t), "own shard should be a view, not a copy"
        frozen = copy.deepcopy(sd)
        pair.step(2)
        _assert_sd_equal(sd, frozen)  # the held dict did not move with training
        for i, st in pair.live().items():
            for k, t in st.items():
                assert not _same_storage(sd["state"][i][k], t)  # the optimizer got a clone
    else:
        pair.step(2)
    pair.assert_in_step()


@world(2)
def test_dropped_dict_costs_no_copy_and_held_views_stay_frozen() -> None:
    pair = _Pair()
    pair.step(2)
    rank = dist.get_rank()
    # 1. saved and dropped: the live state is not copied at the next step
    pair.opt.consolidate_state_dict(0)
    if rank == 0:
        sd = pair.opt.state_dict()
        torch.save(sd, io.BytesIO())
        del sd
    before = {(i, k): t.data_ptr() for i, st in pair.live().items() for k, t in st.items()}
    pair.step()
    after = {(i, k): t.data_ptr() for i, st in pair.live().items() for k, t in st.items()}
    assert before == after
    # 2. only a view of one tensor survives: that tensor is cloned, the view keeps its values
    pair.opt.consolidate_state_dict(0)
    kept: torch.Tensor | None = None
    if rank == 0:
        sd = pair.opt.state_dict()
        i = min(pair.live())
        kept = sd["state"][i]["exp_avg"][:3]
        expected = kept.clone()
        del sd
    pair.step()
    if kept is not None:
        assert torch.equal(kept, expected)
    # 3. two consolidations without a step: the first dict is held, the second dropped
    pair.opt.consolidate_state_dict(0)
    first = pair.opt.state_dict() if rank == 0 else None
    frozen = copy.deepcopy(first)
    pair.opt.consolidate_state_dict(0)
    if rank == 0:
        second = pair.opt.state_dict()
        del second
    pair.step()
    if first is not None and frozen is not None:
        _assert_sd_equal(first, frozen)
    pair.assert_in_step()


@world(2)
def test_repartition_and_load_keep_the_snapshot() -> None:
    pair = _Pair()
    pair.step(2)
    pair.opt.consolidate_state_dict(0)
    sd = pair.opt.state_dict() if dist.get_rank() == 0 else None
    frozen = copy.deepcopy(sd)
    pair.opt.refresh_trainable()  # moves state (all-gather); must not expose the snapshot
    pair.step(2)
    if sd is not None and frozen is not None:
        _assert_sd_equal(sd, frozen)
    pair.opt.consolidate_state_dict(0)
    sd2 = pair.opt.state_dict() if dist.get_rank() == 0 else None
    frozen2 = copy.deepcopy(sd2)
    # Rank 0 reloads its own consolidated dict, rank 1 the reference's (the same values).
    pair.opt.load_state_dict(sd2 if sd2 is not None else _plain_dict_from(pair))
    pair.step()
    if sd2 is not None and frozen2 is not None:
        _assert_sd_equal(sd2, frozen2)
    pair.assert_in_step()


def _plain_dict_from(pair: _Pair) -> dict[str, Any]:
    """The reference optimizer's state as a plain torch dict (a snapshot)."""
    return copy.deepcopy(pair.ref_opt.state_dict())


@world(2)
def test_without_use_counts_the_own_shard_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cow, "_storage_use_count", lambda t: None)
    pair = _Pair()
    pair.step(2)
    pair.opt.consolidate_state_dict(0)
    if dist.get_rank() == 0:
        sd = pair.opt.state_dict()
        for i, st in pair.live().items():
            for k, t in st.items():
                assert not _same_storage(sd["state"][i][k], t)
        frozen = copy.deepcopy(sd)
        pair.step()
        _assert_sd_equal(sd, frozen)
    else:
        pair.step()
    pair.assert_in_step()
