"""Checkpoints that cannot vanish or lie: crash-atomic commits, whole-checkpoint validation on
every rank, checksums, files that must be visible where they are committed, no leftovers.
See [Note: Atomic commit], [Note: Checkpoint checksums] and [Note: Load validation].
"""

from __future__ import annotations

import os
import shutil
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

_HERE = Path(__file__).resolve().parent


def _model(transposed: bool = False, extra_dim: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    if transposed:  # same numel, other shape
        m[0].weight = nn.Parameter(torch.randn(4, 6))
    if extra_dim:  # same numel, one more (size-1) dim
        m[2].weight = nn.Parameter(torch.randn(3, 1, 6))
    return m


def _save_in_subprocess(path: Path, steps: int, crash_at: str, tmp: Path) -> int:
    store = tmp / f"store-{crash_at}-{steps}-{os.getpid()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(
        [
            sys.executable,
            str(_HERE / "_crash_save.py"),
            str(path),
            str(steps),
            crash_at,
            str(store),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if res.returncode not in (0, 17):
        raise AssertionError(f"save subprocess failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res.returncode


def _adam_steps(sd: dict[str, Any]) -> int:
    steps = {int(st["step"]) for st in sd["state"].values()}
    assert len(steps) == 1
    return steps.pop()


_COMMIT_STEPS = ["written", "staged", "marked", "renamed", "pointed", "cleaned"]


@pytest.fixture(scope="module")
def one_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed checkpoint after one step (copied by each crash test)."""
    root = tmp_path_factory.mktemp("one_step")
    assert _save_in_subprocess(root / "ckpt", 1, "none", root) == 0
    return root / "ckpt"


@pytest.mark.parametrize("crash_at", _COMMIT_STEPS)
def test_crash_at_each_commit_step_leaves_old_or_new(
    crash_at: str, one_step: Path, tmp_path: Path
) -> None:
    """A save over a committed checkpoint killed at each step of its commit: the path always
    loads, the old checkpoint until the pointer moved and the new one after."""
    path = tmp_path / "ckpt"
    shutil.copytree(one_step, path)
    assert _save_in_subprocess(path, 2, crash_at, tmp_path) == 17
    assert path.is_dir()
    want = 2 if _COMMIT_STEPS.index(crash_at) >= _COMMIT_STEPS.index("pointed") else 1
    assert _adam_steps(load_consolidated(path)) == want
    if crash_at == "marked":  # the next save cleans up what the crash left and commits
        assert _save_in_subprocess(path, 3, "none", tmp_path) == 0
        assert _adam_steps(load_consolidated(path)) == 3
        assert sorted(os.listdir(path))[0] == "LATEST" and len(os.listdir(path)) == 2


@pytest.mark.parametrize("crash_at", ["written", "pointed", "rooted"])
def test_crash_during_the_first_save_leaves_nothing_or_everything(
    crash_at: str, tmp_path: Path
) -> None:
    """The first save to a path: ``exists(path)`` is true only once it loads."""
    path = tmp_path / "ckpt"
    assert _save_in_subprocess(path, 1, crash_at, tmp_path) == 17
    if crash_at == "rooted":  # after the rename that makes it appear
        assert _adam_steps(load_consolidated(path)) == 1
    else:
        assert not path.exists()
    assert _save_in_subprocess(path, 2, "none", tmp_path) == 0
    assert _adam_steps(load_consolidated(path)) == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_0_1_checkpoint_still_loads_and_is_converted(one_step: Path, tmp_path: Path) -> None:
    """The layout of shardkit-optim 0.1 (files and marker directly in the path)."""
    path = tmp_path / "ckpt"
    shutil.copytree(one_step, path)
    version = path / (path / "LATEST").read_text().strip()
    legacy = tmp_path / "legacy"
    version.rename(legacy)  # a 0.1 checkpoint: DCP files + SHARDKIT_COMMIT, no pointer
    assert _adam_steps(load_consolidated(legacy)) == 1
    assert _save_in_subprocess(legacy, 2, "none", tmp_path) == 0
    assert _adam_steps(load_consolidated(legacy)) == 2
    assert sorted(os.listdir(legacy))[0] == "LATEST" and len(os.listdir(legacy)) == 2


# ---------------------------------------------------------------------------- validation


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reliability")


@world(2)
def test_save_for_the_validation_tests(saved: Path) -> None:
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, 2, batch=6)
    save_sharded(opt, saved / "ckpt")


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("transposed", r"param 0 was saved with shape \(6, 4\) but has shape \(4, 6\)"),
        ("extra_dim", r"param 2 was saved with shape \(3, 6\) but has shape \(3, 1, 6\)"),
    ],
)
@world(2, timeout=60)
def test_shape_mismatch_raises_on_every_rank(saved: Path, variant: str, message: str) -> None:
    """Whatever rank owns the mismatching param, every rank raises before any collective."""
    model = _model(**{variant: True})
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    with pytest.raises(ValueError, match=message):
        load_sharded(opt, saved / "ckpt")
    dist.barrier()  # every rank is still in step


@world(2, timeout=60)
def test_plain_state_dict_shape_check_is_exact() -> None:
    """load_state_dict of a consolidated dict checks every entry exactly, on every rank."""
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, 1, batch=6)
    opt.consolidate_state_dict(-1)
    sd = opt.state_dict()
    sd["state"][2]["exp_avg"] = sd["state"][2]["exp_avg"].reshape(3, 1, 6)
    with pytest.raises(ValueError, match=r"entry 2\['exp_avg'\] has shape \(3, 1, 6\)"):
        opt.load_state_dict(sd)


def _flip_a_payload_byte(version: Path, key: str, value: torch.Tensor) -> None:
    """Overwrites one byte inside ``value``'s raw bytes in whichever file holds them."""
    raw = value.detach().contiguous().view(torch.uint8).numpy().tobytes()
    for f in version.glob("*.distcp"):
        data = bytearray(f.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at + len(raw) // 2] ^= 0x40
            f.write_bytes(bytes(data))
            return
    raise AssertionError(f"the bytes of {key} were not found in any file")


@world(2, timeout=60)
def test_corrupted_payload_is_refused_naming_the_item(saved: Path) -> None:
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, 2, batch=6)
    target = saved / "corrupt"
    save_sharded(opt, target)
    dist.barrier()
    opt.consolidate_state_dict(0)
    if dist.get_rank() == 0:
        version = target / (target / "LATEST").read_text().strip()
        _flip_a_payload_byte(version, "state/2/exp_avg", opt.state_dict()["state"][2]["exp_avg"])
    dist.barrier()
    fresh = ShardedOptimizer(_model().parameters(), optim=torch.optim.Adam, lr=0.01)
    with pytest.raises(ValueError, match=r"item 'state/2/exp_avg' \(file __\d_\d\.distcp\) fails"):
        load_sharded(fresh, target)
    if dist.get_rank() == 0:
        with pytest.raises(ValueError, match=r"'state/2/exp_avg'.*fails its checksum"):
            load_consolidated(target)
    dist.barrier()


@world(2, timeout=90)
def test_files_not_visible_to_the_committer_fail_the_save_on_every_rank(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 writes to a directory rank 0 cannot see (no shared filesystem): nothing is
    committed, every rank raises, and the staging directory is gone."""
    import shardkit.checkpoint._api as api  # what shardkit.checkpoint.save writes with

    if dist.get_rank() == 1:
        private = tmp_path / "rank1-local"
        real = api._dcp_save

        def local_save(sd: Any, storage_writer: Any, **kw: Any) -> Any:
            private.mkdir(exist_ok=True)
            return real(sd, storage_writer=type(storage_writer)(private), **kw)

        monkeypatch.setattr(api, "_dcp_save", local_save)
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, 1, batch=6)
    target = saved / "unshared"
    with pytest.raises(RuntimeError, match=r"not visible .* from the rank committing it"):
        save_sharded(opt, target)
    dist.barrier()
    assert not target.exists()
    assert not [p for p in saved.iterdir() if p.name.startswith(".unshared")]


@world(2)
def test_leftovers_of_crashed_saves_are_removed_by_the_next_save(saved: Path) -> None:
    target = saved / "ckpt"
    if dist.get_rank() == 0:
        (saved / ".ckpt.tmp-0123").mkdir()
        (target / ".v-0123.tmp").mkdir()
        (target / ".LATEST.tmp-0123").write_text("v-x\n")
    dist.barrier()
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, 1, batch=6)
    save_sharded(opt, target)
    dist.barrier()
    assert sorted(os.listdir(target))[0] == "LATEST" and len(os.listdir(target)) == 2
    assert not (saved / ".ckpt.tmp-0123").exists()
