"""Logging (``shardkit.optim``), profiler ranges, and the state-dict behaviour that
torch.distributed.checkpoint.state_dict relies on (implicit consolidation, state truthiness,
named param ids).

Rank bodies cannot use pytest's ``caplog`` (they run in the world's processes):
``shardkit.testing.captured_logs("shardkit.optim")`` does its job there.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _optim_testkit import assert_state_equal, train
from shardkit.optim import ShardedOptimizer
from shardkit.testing import captured_logs, world
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))


@world(2)
def test_step_phases_show_in_a_profiler_trace() -> None:
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(model, opt, 1, start=1)
        opt.clip_grad_norm(1.0)
        opt.consolidate_state_dict(recipient_rank=0)
    names = {e.name for e in prof.events()}
    want = {
        "shardkit.optim.agree",
        "shardkit.optim.local_step",
        "shardkit.optim.sync",
        "shardkit.optim.clip_grad_norm",
        "shardkit.optim.consolidate",
    }
    assert want <= names, sorted(want - names)


@world(2)
def test_repartition_and_implicit_consolidation_are_logged_once() -> None:
    import shardkit.optim._sharded_optimizer as so
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    with pytest.MonkeyPatch.context() as mp, captured_logs("shardkit.optim") as logs:
        mp.setattr(so, "_logged_repartition", False)
        mp.setattr(so, "_logged_implicit", False)
        train(model, opt, 1)
        opt.state_dict()
        opt.state_dict()  # current: no second consolidation, nothing logged
        train(model, opt, 1, start=1)
        opt.state_dict()  # stale: consolidates again, not logged again
        first = next(model.parameters())
        for step, trainable in enumerate((False, True), start=2):
            first.requires_grad_(trainable)  # freeze, then unfreeze: two repartitions
            with pytest.warns(UserWarning, match="repartitioning"):
                train(model, opt, 1, start=step)
    assert len(logs.matching("repartitioning at this step")) == 1
    assert len(logs.matching("consolidating the full optimizer state onto every rank")) == 1


@world(3)
def test_state_truthiness_is_the_same_on_every_rank() -> None:
    """Rank 2 owns no param (two params over three ranks): its local state stays empty, yet
    ``bool(opt.state)`` is the same everywhere, so torch's DCP helpers take their
    state-creating step on every rank or on none (see [Note: State truthiness])."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ref_model = copy.deepcopy(model)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.1)
    assert not opt.state
    train(model, opt, 2)
    train(ref_model, ref, 2)
    assert opt.state and (len(opt.state) == 0) == (dist.get_rank() == 2)
    _, osd = get_state_dict(model, optimizers=opt)
    _, ref_osd = get_state_dict(ref_model, optimizers=ref)
    assert_state_equal(osd, ref_osd)
    fresh = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.5)
    set_state_dict(model, optimizers=fresh, model_state_dict={}, optim_state_dict=osd)
    assert fresh.state and fresh.param_groups[0]["lr"] == 0.1
    assert_state_equal(fresh.state_dict(), ref.state_dict())


@world(2)
def test_explicit_consolidation_keeps_its_errors_and_never_communicates_alone() -> None:
    """After an explicit consolidation onto rank 1, state_dict() on rank 0 raises at once (no
    implicit collective), and rank 1's copy goes stale after a step, as documented."""
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    train(model, opt, 1)
    opt.consolidate_state_dict(recipient_rank=1)
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match=r"recipient_rank=-1\) on every rank"):
            opt.state_dict()
    else:
        assert len(opt.state_dict()["state"]) == 4
    train(model, opt, 1, start=1)
    with pytest.raises(RuntimeError, match=r"stale|not been consolidated"):
        opt.state_dict()


@world(1)
def test_load_state_dict_takes_named_param_ids() -> None:
    """Names instead of indices (what DCP hands back), matched by position; bad names raise."""
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    train(ref_model, ref, 2)
    sd = ref.state_dict()
    names = [n for n, _ in ref_model.named_parameters()]
    named = {
        "state": {names[i]: st for i, st in sd["state"].items()},
        "param_groups": [
            dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]
        ],
    }
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.5)
    opt.load_state_dict(named)
    assert_state_equal(opt.state_dict(all_ranks=True), sd)
    bad = {**named, "state": {**named["state"], "nope.weight": sd["state"][0]}}
    with pytest.raises(ValueError, match=r"'nope\.weight'"):
        opt.load_state_dict(bad)
    dup = {**named, "param_groups": [dict(named["param_groups"][0], params=[names[0]] * 4)]}
    with pytest.raises(ValueError, match="unique names"):
        opt.load_state_dict(dup)


@world(1)
def test_sparse_params_are_refused_at_construction() -> None:
    """torch's ZeroRedundancyOptimizer raises ValueError for sparse params; so does shardkit's
    (it used to accept them, frozen or not, and fail later)."""
    from shardkit.optim import ZeroRedundancyOptimizer

    sparse = torch.sparse_coo_tensor(size=(2, 3))
    for params in ([sparse], [torch.ones(1), sparse.clone().requires_grad_()]):
        with pytest.raises(ValueError, match=r"dense params only.*torch\.sparse_coo"):
            ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)


@world(2)
def test_params_moved_by_module_to_are_reattached_and_logged_once() -> None:
    """``model.to("cpu:0")`` (what Accelerate does) copies every param; the next step
    re-attaches them to the flat buckets, so training matches a plain optimizer bit for bit
    (before, the owners' updates never reached the other ranks)."""
    import shardkit.optim._sync as sync

    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, 1)
    train(ref_model, ref, 1)
    storage = next(model.parameters()).untyped_storage().data_ptr()
    model.to(torch.device("cpu", 0))
    assert next(model.parameters()).untyped_storage().data_ptr() != storage  # it copied
    with pytest.MonkeyPatch.context() as mp, captured_logs("shardkit.optim") as logs:
        mp.setattr(sync, "_logged_reattach", False)
        train(model, opt, 3, start=1)
        model.to(torch.device("cpu", 0))
        train(model, opt, 1, start=4)
    train(ref_model, ref, 4, start=1)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(logs.matching("were given new storage since it was built")) == 1
