"""Sharded DCP checkpoints: resharding N -> M, crash safety, and the offline CLI.

Tests in this module run in order: the save tests write the checkpoints that the load tests
(at other world sizes) and the CLI test read. Every rank trains on the same full batch, so a
resumed run must match an uninterrupted single-process run bit for bit.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _optim_testkit import train
from shardkit.optim import ShardedOptimizer, load_consolidated, load_sharded, save_sharded
from shardkit.testing import world
from torch import nn

_K, _J = 3, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    ps = list(model.parameters())
    return [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.02}]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("optim_ckpt")


def _save(root: Path, name: str) -> None:
    model = _model()
    opt = ShardedOptimizer(_groups(model), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, _K, batch=6)
    save_sharded(opt, root / name)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), root / f"{name}.model.pt")
    dist.barrier()
    # one committed version behind the pointer, nothing left of the staging
    files = sorted(os.listdir(root / name))
    assert files[0] == "LATEST" and len(files) == 2, files
    version = root / name / (root / name / "LATEST").read_text().strip()
    assert {"SHARDKIT_COMMIT", ".metadata"} <= set(os.listdir(version))
    assert not [f for f in os.listdir(root) if ".tmp-" in f]


def _resume_and_compare(root: Path, name: str) -> None:
    ref_model = _model()
    ref = torch.optim.Adam(_groups(ref_model), lr=0.01)
    train(ref_model, ref, _K + _J, batch=6)
    model = _model()
    model.load_state_dict(torch.load(root / f"{name}.model.pt"))
    opt = ShardedOptimizer(_groups(model), optim=torch.optim.Adam, lr=0.01)
    load_sharded(opt, root / name)
    assert opt.param_groups[1]["lr"] == 0.02
    train(model, opt, _J, start=_K, batch=6)
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@world(2)
def test_save_world2(ckpt_root: Path) -> None:
    _save(ckpt_root, "w2")


@world(4)
def test_save_world4(ckpt_root: Path) -> None:
    _save(ckpt_root, "w4")


@world(3)
def test_load_2_to_3(ckpt_root: Path) -> None:
    _resume_and_compare(ckpt_root, "w2")


@world(1)
def test_load_2_to_1(ckpt_root: Path) -> None:
    _resume_and_compare(ckpt_root, "w2")


@world(2)
def test_load_4_to_2(ckpt_root: Path) -> None:
    _resume_and_compare(ckpt_root, "w4")


@world(2)
def test_failed_save_commits_nothing_and_leaves_nothing(
    ckpt_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardkit.checkpoint._commit import Staging

    model = _model()
    opt = ShardedOptimizer(_groups(model), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, 1, batch=6)

    def crash(*args: Any) -> None:
        raise OSError("simulated failure before commit")

    monkeypatch.setattr(Staging, "commit", crash)
    target = ckpt_root / f"crash{dist.get_world_size()}"
    with pytest.raises(RuntimeError, match="simulated failure"):
        save_sharded(opt, target)
    dist.barrier()
    assert not target.exists()
    assert not [f for f in os.listdir(ckpt_root) if ".tmp-" in f]  # the staging was removed
    with pytest.raises(FileNotFoundError, match=r"not a committed shardkit checkpoint"):
        load_sharded(opt, ckpt_root)
    # a failed save over an existing checkpoint leaves the old one loadable
    with pytest.raises(RuntimeError, match="simulated failure"):
        save_sharded(opt, ckpt_root / "w2")
    assert sorted(os.listdir(ckpt_root / "w2"))[0] == "LATEST"
    assert len(os.listdir(ckpt_root / "w2")) == 2
    _resume_and_compare(ckpt_root, "w2")


def test_cli_consolidate(ckpt_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-m", "shardkit.optim", "consolidate", str(ckpt_root / "w4"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    sd = torch.load(out)
    # equals the state of an uninterrupted plain run after _K steps
    ref_model = _model()
    ref = torch.optim.Adam(_groups(ref_model), lr=0.01)
    train(ref_model, ref, _K, batch=6)
    refsd = copy.deepcopy(ref.state_dict())
    assert sd["param_groups"] == refsd["param_groups"]
    for i, st in refsd["state"].items():
        for k, v in st.items():
            assert torch.equal(sd["state"][i][k], v), (i, k)
    # it loads into the plain optimizer
    torch.optim.Adam(_groups(_model()), lr=0.01).load_state_dict(sd)
    assert load_consolidated(ckpt_root / "w4")["state"].keys() == sd["state"].keys()
    bad = subprocess.run(
        [sys.executable, "-m", "shardkit.optim", "consolidate", str(tmp_path), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "not a committed shardkit checkpoint" in bad.stderr


class _PlainOptimizer:
    """Not a ShardedOptimizer: a torch optimizer that one rank holds whole, exposing
    :class:`ShardedCheckpointable` (global index = position in its param groups)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.group = dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.param_groups = opt.param_groups

    @property
    def collective_timeout(self) -> Any:
        return None

    def local_state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.opt.state_dict())

    def checkpoint_indices(self) -> list[int]:
        return list(range(sum(len(g["params"]) for g in self.param_groups)))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.opt.load_state_dict(state_dict)


@world(1)
def test_any_sharded_checkpointable_saves_and_loads(tmp_path: Path) -> None:
    """save_sharded / load_sharded need only the public ShardedCheckpointable protocol, which
    ShardedOptimizer implements (checkpoint_indices is public: what this rank loads)."""
    from shardkit.optim import ShardedCheckpointable

    model = _model()
    sharded = ShardedOptimizer(_groups(model), optim=torch.optim.Adam, lr=0.01)
    assert isinstance(sharded, ShardedCheckpointable)
    assert sharded.checkpoint_indices() == list(range(6))
    plain = _PlainOptimizer(torch.optim.Adam(_groups(model), lr=0.01))
    assert isinstance(plain, ShardedCheckpointable)
    train(model, plain.opt, 2, batch=6)
    save_sharded(plain, tmp_path / "ckpt")
    want = plain.opt.state_dict()
    got = load_consolidated(tmp_path / "ckpt")
    assert got["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in st.items())
    load_sharded(sharded, tmp_path / "ckpt")  # into the sharded optimizer
    for i, st in want["state"].items():
        assert all(torch.equal(sharded.state_dict()["state"][i][k], v) for k, v in st.items())
