"""A checkpoint error found by one rank alone raises the same error on every rank.

``save_sharded`` and ``load_sharded`` decide every failure through the agreement module
(``agreed_error`` / ``agree_outcome``): whichever rank fails, every rank raises the same exception
type with the same message, and the group stays in step. ``load_consolidated`` (one process)
raises the same types as ``load_sharded`` does for the same fault.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _optim_testkit import assert_state_equal, train
from shardkit.checkpoint import CheckpointNotFoundError, CheckpointSaveError
from shardkit.optim import (
    ShardedOptimizer,
    UnsafeCheckpointError,
    load_consolidated,
    load_sharded,
    save_sharded,
)
from shardkit.optim._agreement import REFUSED, agreed_error, outcome
from shardkit.testing import world
from torch import nn

_V1 = Path(__file__).resolve().parent / "data" / "v1" / "ckpt"  # format 1: needs allow_pickle


def _trained() -> ShardedOptimizer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, 1, batch=6)
    return opt


def _same_on_every_rank(exc: BaseException) -> None:
    """Every rank raised this exact type with this exact message."""
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (type(exc).__name__, str(exc)))
    assert all(g == got[0] for g in got), got


# ---------------------------------------------------------------- the decision


def test_agreed_error_raises_the_first_failing_ranks_type_and_message() -> None:
    outcomes = [None, outcome(FileNotFoundError("gone")), outcome(ValueError("bad"))]
    error = agreed_error(outcomes, "op")
    assert type(error) is FileNotFoundError
    fields = {"what": "op", "rank": 1, "world": 3, "kind": "FileNotFoundError", "message": "gone"}
    assert str(error) == REFUSED.format(also=" (rank(s) [2] failed too)", **fields)
    unsafe = agreed_error(
        [None, outcome(UnsafeCheckpointError("x" * 3000))], "w", template="{message:.5}"
    )
    assert type(unsafe) is UnsafeCheckpointError and str(unsafe) == "xxxxx"
    other = agreed_error(
        [outcome(PermissionError("no"))], "w", template="{what}: {kind}", default=ValueError
    )
    assert type(other) is ValueError and str(other) == "w: PermissionError"
    assert agreed_error([None, None], "op") is None


# ---------------------------------------------------------------- save_sharded


@pytest.mark.parametrize("stage", ["local state", "write"])
@world(2, timeout=90)
def test_save_failing_on_one_rank_raises_on_every_rank(
    stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 alone fails (a state value it cannot record / its DCP write): every rank raises
    the same RuntimeError naming rank 1, nothing is committed and the staging is gone."""
    import shardkit.checkpoint._commit as commit
    import shardkit.optim._checkpoint as ck

    opt = _trained()
    if dist.get_rank() == 1:
        if stage == "local state":

            def refuse(local: dict[str, Any]) -> Any:
                raise TypeError("simulated: a state value that is not JSON-like")

            monkeypatch.setattr(ck, "_local_items", refuse)
        else:

            def fail(name: str) -> None:
                if name == "written":
                    raise OSError("simulated: disk full")

            monkeypatch.setattr(commit, "crash_point", fail)
    cause = "simulated: a state value" if stage == "local state" else "OSError: simulated: disk"
    target = tmp_path / "ckpt"
    expected = rf"save_sharded\(.*ckpt\) failed, nothing was committed: rank 1: {cause}"
    with pytest.raises(RuntimeError, match=expected) as info:
        save_sharded(opt, target)
    assert type(info.value) is CheckpointSaveError
    _same_on_every_rank(info.value)
    assert not target.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    monkeypatch.undo()
    save_sharded(opt, target)  # the group is still in step
    load_sharded(_trained(), target)


# ---------------------------------------------------------------- load_sharded


def _rank1_view(fault: str, good: Path, tmp_path: Path) -> Path:
    """The checkpoint as rank 1 sees it (made by rank 1 only); rank 0 sees ``good``."""
    if fault == "missing":
        return tmp_path / "not-here"
    if fault == "format 1":
        return _V1
    copy = tmp_path / "rank1-copy"
    shutil.copytree(good, copy)
    version = copy / (copy / "LATEST").read_text().strip()
    (version / "SHARDKIT_COMMIT").write_bytes(b"")  # fault == "empty commit record"
    return copy


@pytest.mark.parametrize(
    ("fault", "kind", "message"),
    [
        ("missing", CheckpointNotFoundError, r"not-here is not a committed shardkit checkpoint"),
        ("empty commit record", UnsafeCheckpointError, r"commit record.*is empty"),
        ("format 1", UnsafeCheckpointError, r"format shardkit\.optim\.sharded/1.*allow_pickle"),
    ],
)
@world(2, timeout=90)
def test_load_refused_on_one_rank_raises_on_every_rank(
    fault: str, kind: type[Exception], message: str, tmp_path: Path
) -> None:
    """Only rank 1 sees a missing / damaged / unsafe checkpoint (no shared filesystem): every
    rank raises rank 1's exception type and message before DCP reads anything."""
    opt = _trained()
    good = tmp_path / "ckpt"
    save_sharded(opt, good)
    path = _rank1_view(fault, good, tmp_path) if dist.get_rank() == 1 else good
    with pytest.raises(kind, match=message) as info:
        load_sharded(_trained(), path)
    assert type(info.value) is kind
    _same_on_every_rank(info.value)
    fresh = _trained()
    load_sharded(fresh, good)  # the group is still in step
    assert_state_equal(opt.state_dict(all_ranks=True), fresh.state_dict(all_ranks=True))


@pytest.mark.parametrize("kind", [ValueError, UnsafeCheckpointError])
@world(2, timeout=90)
def test_damaged_item_found_by_one_rank_raises_on_every_rank(
    kind: type[Exception], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank verifies only the items it read: rank 1 alone finds one damaged (or crafted)
    and every rank raises its exception type and message."""
    import shardkit.optim._checkpoint as ck

    opt = _trained()
    save_sharded(opt, tmp_path / "ckpt")
    if dist.get_rank() == 1:

        def refuse(opened: Any, loaded: Any) -> Any:
            raise kind("item 'state/1/exp_avg' fails its checksum (simulated)")

        monkeypatch.setattr(ck, "_verify_and_assemble", refuse)
    with pytest.raises(kind, match=r"load_sharded\(.*ckpt\): item 'state/1/exp_avg' fails") as info:
        load_sharded(_trained(), tmp_path / "ckpt")
    assert type(info.value) is kind
    _same_on_every_rank(info.value)
    monkeypatch.undo()
    load_sharded(_trained(), tmp_path / "ckpt")  # the group is still in step


# ---------------------------------------------------------------- load_consolidated


@pytest.mark.parametrize("kind", [ValueError, UnsafeCheckpointError])
@world(1, timeout=90)
def test_load_consolidated_raises_the_types_load_sharded_raises(
    kind: type[Exception], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offline load (one process, no agreement) raises the same types, with its own name
    and the whole message."""
    import shardkit.optim._checkpoint as ck

    save_sharded(_trained(), tmp_path / "ckpt")
    for missing in (load_consolidated, lambda p: load_sharded(_trained(), p)):
        with pytest.raises(FileNotFoundError, match="is not a committed") as info:
            missing(tmp_path / "not-here")
        assert type(info.value) is CheckpointNotFoundError
    for unsafe in (load_consolidated, lambda p: load_sharded(_trained(), p)):
        with pytest.raises(UnsafeCheckpointError, match="allow_pickle") as info:
            unsafe(_V1)
        assert type(info.value) is UnsafeCheckpointError
    long = "y" * 2500

    def refuse(opened: Any, loaded: Any) -> Any:
        raise kind(long)

    monkeypatch.setattr(ck, "_verify_and_assemble", refuse)
    with pytest.raises(kind) as info:
        load_consolidated(tmp_path / "ckpt")
    assert type(info.value) is kind
    assert str(info.value) == f"load_consolidated({tmp_path / 'ckpt'}): {long}"
    with pytest.raises(kind) as info:
        load_sharded(_trained(), tmp_path / "ckpt")
    assert type(info.value) is kind
    assert str(info.value) == f"load_sharded({tmp_path / 'ckpt'}): {long[:2000]}"
