"""Consolidation, plain-format state dicts, loading at any world size, and their errors.

Every rank trains on the same full batch (no DDP), so the sharded run must match a plain
optimizer in one process bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _optim_testkit import assert_state_equal, train
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 2))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    ps = list(model.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.003, "weight_decay": 0.01}]


def _pair(cls: type[torch.optim.Optimizer] = torch.optim.AdamW) -> tuple[Any, ...]:
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ref = cls(_groups(ref_model), lr=0.01)
    opt = ShardedOptimizer(_groups(model), optim=cls, lr=0.01)
    return ref_model, ref, model, opt


@pytest.mark.parametrize("recipient", [0, 1, -1])
@world(2)
def test_consolidated_matches_plain_optimizer(recipient: int) -> None:
    ref_model, ref, model, opt = _pair()
    train(ref_model, ref, 3)
    train(model, opt, 3)
    opt.consolidate_state_dict(recipient_rank=recipient)
    if recipient in (-1, dist.get_rank()):
        sd = opt.state_dict()
        assert_state_equal(sd, ref.state_dict())
        assert all(
            t.device.type == "cpu"
            for st in sd["state"].values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        )
        # it loads into the plain optimizer of the same class and continues identically
        plain_model = copy.deepcopy(model)
        plain = torch.optim.AdamW(_groups(plain_model), lr=0.01)
        plain.load_state_dict(sd)
        train(plain_model, plain, 2, start=3)
        train(ref_model, ref, 2, start=3)
        for a, b in zip(ref_model.parameters(), plain_model.parameters(), strict=True):
            assert torch.equal(a, b)
    else:
        with pytest.raises(RuntimeError, match="not been consolidated on this rank"):
            opt.state_dict()


@world(3)
def test_load_plain_state_dict_any_world_size() -> None:
    # a plain optimizer's dict from one process loads at world size 3 and training continues
    ref_model, ref, model, opt = _pair(torch.optim.Adam)
    train(ref_model, ref, 2)
    sd = copy.deepcopy(ref.state_dict())  # a snapshot: ref's own dict aliases its live state
    before = copy.deepcopy(sd)
    model.load_state_dict(ref_model.state_dict())
    opt.load_state_dict(sd)
    assert_state_equal(sd, before)  # the caller's dict is untouched ...
    train(model, opt, 2, start=2)
    assert_state_equal(sd, before)  # ... and not aliased by live state
    train(ref_model, ref, 2, start=2)
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    # hyperparams came from the dict
    assert opt.param_groups[1]["lr"] == 0.003 and opt.optim.param_groups[1]["lr"] == 0.003


@world(2)
def test_state_dict_all_ranks_and_staleness() -> None:
    _ref_model, _ref, model, opt = _pair(torch.optim.SGD)
    train(model, opt, 1)
    sd = opt.state_dict(all_ranks=True)
    assert len(sd["param_groups"]) == 2
    sd["param_groups"][0]["lr"] = 123.0  # the returned dict is the caller's to mutate
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.01
    train(model, opt, 1)
    with pytest.raises(RuntimeError, match="stale"):
        opt.state_dict()


@world(2)
def test_selective_consolidation_skips_tensors() -> None:
    ref_model, ref, model, opt = _pair(torch.optim.Adam)
    train(ref_model, ref, 2)
    train(model, opt, 2)
    skipped = list(model.parameters())[2]  # second Linear's weight: global index 2
    opt.consolidate_state_dict(recipient_rank=0, skip=lambda p: p is skipped)
    local = opt.local_state_dict()["state"]
    if dist.get_rank() != 0:
        return
    sd = opt.state_dict()
    refsd = ref.state_dict()
    assert sd["state"].keys() == refsd["state"].keys()
    entry = sd["state"][2]
    assert entry["exp_avg"].shape == skipped.shape
    if opt.param_to_rank[skipped] == 0:
        assert torch.equal(entry["exp_avg"], refsd["state"][2]["exp_avg"])
        assert 2 in local
    else:
        assert entry["exp_avg"].is_meta and entry["exp_avg_sq"].is_meta
    for i in (0, 1, 3, 4, 5):
        assert torch.equal(sd["state"][i]["exp_avg"], refsd["state"][i]["exp_avg"])


@world(2)
def test_load_skips_meta_placeholders() -> None:
    _ref_model, _ref, model, opt = _pair(torch.optim.Adam)
    train(model, opt, 2)
    opt.consolidate_state_dict(recipient_rank=-1, skip=lambda p: p.dim() == 1)
    sd = opt.state_dict()
    live = {i: st["exp_avg"].clone() for i, st in opt.local_state_dict()["state"].items()}
    opt.load_state_dict(sd)
    for i, st in opt.local_state_dict()["state"].items():
        assert torch.equal(st["exp_avg"], live[i])


@world(2)
def test_bad_state_dicts_raise() -> None:
    _, ref, _model_unused, opt = _pair(torch.optim.Adam)
    with pytest.raises(TypeError, match="expects a dict"):
        opt.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing"):
        opt.load_state_dict({"state": {}})
    other = torch.optim.Adam(nn.Linear(5, 7).parameters())
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(other.state_dict())
    sd = ref.state_dict()
    sd["param_groups"][1]["params"] = sd["param_groups"][1]["params"][:-1]
    with pytest.raises(ValueError, match="hold"):
        opt.load_state_dict(sd)
    # same layout but a different shape
    wrong = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 2))
    wopt = torch.optim.Adam(_groups(wrong))
    nn.functional.mse_loss(wrong(torch.randn(2, 5)), torch.randn(2, 2)).backward()
    wopt.step()
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(wopt.state_dict())
    for bad in (2, -2, 1.0, True):
        with pytest.raises(ValueError, match="recipient_rank"):
            opt.consolidate_state_dict(recipient_rank=bad)  # type: ignore[arg-type]


@world(2)
def test_recipient_mismatch_raises_on_every_rank() -> None:
    _, _, _m, opt = _pair(torch.optim.SGD)
    with pytest.raises(ValueError, match="different recipient"):
        opt.consolidate_state_dict(recipient_rank=dist.get_rank())


@world(2)
def test_consolidation_needs_no_numpy(tmp_path: Any) -> None:
    """torch does not depend on NumPy: consolidation must not need it (torch's object
    collectives do); sharded checkpoints (DCP) do need it and say so up front."""
    import sys

    from shardkit.optim import save_sharded

    ref_model, ref, model, opt = _pair()
    train(ref_model, ref, 2)
    train(model, opt, 2)
    with pytest.MonkeyPatch.context() as mp:

        def no_numpy(self: torch.Tensor, *args: object, **kwargs: object) -> None:
            raise RuntimeError("Numpy is not available")

        mp.setattr(torch.Tensor, "numpy", no_numpy)
        opt.consolidate_state_dict(recipient_rank=-1)
        assert_state_equal(opt.state_dict(), ref.state_dict())
        mp.setitem(sys.modules, "numpy", None)  # find_spec("numpy") -> None: "not installed"
        with pytest.raises(RuntimeError, match="pip install numpy"):
            save_sharded(opt, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
