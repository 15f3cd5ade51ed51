"""The consolidated state dict is a snapshot: a real copy that training never writes into."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


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
def test_own_shard_is_copied_and_the_dict_stays_a_snapshot(recipient: int) -> None:
    pair = _Pair()
    pair.step(2)
    pair.opt.consolidate_state_dict(recipient)
    if dist.get_rank() == recipient:
        sd = pair.opt.state_dict()
        live = pair.live()
        assert live, "this rank owns some params"
        for i, st in live.items():
            for k, t in st.items():
                assert not _same_storage(sd["state"][i][k], t), "own shard must be copied"
        frozen = copy.deepcopy(sd)
        pair.step(2)
        _assert_sd_equal(sd, frozen)  # the held dict did not move with training
    else:
        pair.step(2)
    pair.assert_in_step()


@world(2)
def test_views_of_live_state_taken_and_dropped_never_leak_into_the_dict() -> None:
    """Issue 25: views, detached views and two views of live state tensors, created before
    consolidation and dropped before ``step()``, must not let ``step()`` write into the dict."""
    pair = _Pair()
    pair.step(2)
    rank = dist.get_rank()
    live = pair.live()
    i = min(live)
    t = live[i]["exp_avg"]
    views = [t[:1], t.detach()[:1], t.view(-1)[:2], t.view(-1)[1:3], t.detach()]
    pair.opt.consolidate_state_dict(0)
    sd = pair.opt.state_dict() if rank == 0 else None
    frozen = copy.deepcopy(sd)
    del views, t, live
    pair.step(2)
    if sd is not None and frozen is not None:
        _assert_sd_equal(sd, frozen)
    # and a view of the *dict* held across steps keeps its values
    pair.opt.consolidate_state_dict(0)
    if rank == 0:
        sd = pair.opt.state_dict()
        kept = sd["state"][min(sd["state"])]["exp_avg"].view(-1)[:3]
        expected = kept.clone()
        del sd
    pair.step()
    if rank == 0:
        assert torch.equal(kept, expected)
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
