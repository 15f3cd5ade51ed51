"""``shardkit.checkpoint.save`` / ``load`` of any DCP state dict: round trips, the atomic commit
and its crash safety, CRC-32s, the load checks, typed errors raised on every rank.

See [Note: Atomic commit], [Note: Checkpoint checksums], [Note: Load checks] and [Note:
Checkpoint agreement].
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _ckpt_testkit import assert_same, model_and_optim, state_of, train
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.checkpoint import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ChecksumError,
    UnsafeCheckpointError,
    load,
    open_checkpoint,
    save,
)
from shardkit.testing import world

_HERE = Path(__file__).resolve().parent


def _steps(path: Path) -> int:
    """The step count of the checkpoint at ``path`` (loaded, verified)."""
    dest = state_of(*model_and_optim(seed=1))
    ck = load(dest, path)
    assert ck.record is not None and ck.record["step"] == dest["step"]
    return int(dest["step"])


# ------------------------------------------------------------------ round trips

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool]
_SHAPES = [(), (0,), (1,), (2, 0), (3,), (2, 3), (1, 1, 4)]
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner),
    max_leaves=6,
)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    tensors=st.lists(st.tuples(st.sampled_from(_SHAPES), st.sampled_from(_DTYPES)), max_size=5),
    values=st.dictionaries(st.sampled_from(["a", "b", "c"]), _VALUES, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_any_state_dict_round_trips(
    tmp_path_factory: pytest.TempPathFactory,
    tensors: list[tuple[tuple[int, ...], torch.dtype]],
    values: dict[str, Any],
    seed: int,
) -> None:
    """Any shapes (``()``, 0-size, ...), dtypes and non-tensor values: saved, loaded back bit
    for bit into a state dict of the same structure, verified by the CLI's check."""
    from shardkit.checkpoint import verify

    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {
        f"t{i}": (torch.randn(shape, generator=g) * 100).to(dtype)
        for i, (shape, dtype) in enumerate(tensors)
    }
    state["values"] = values
    path = tmp_path_factory.mktemp("rt") / "ckpt"
    save(state, path)
    dest: dict[str, Any] = {k: torch.zeros_like(v) for k, v in state.items() if k != "values"}
    dest["values"] = {k: None for k in values}
    load(dest, path)
    assert_same(state, dest)
    assert verify(path).checksums == "storage"


def test_layout_record_and_token(tmp_path: Path) -> None:
    """One version behind LATEST, the commit record's fields, record= and token= round trip."""
    model, opt = model_and_optim()
    token = "ab" * 16
    version = save(state_of(model, opt), tmp_path / "ckpt", record={"step": 3}, token=token)
    assert version == tmp_path / "ckpt" / f"v-{token}"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["LATEST", f"v-{token}"]
    record = json.loads((version / "SHARDKIT_COMMIT").read_text())
    assert record["layout"] == "shardkit.checkpoint/1" and record["token"] == token
    assert record["world_size"] == 1 and record["step"] == 3
    ck = open_checkpoint(tmp_path / "ckpt")
    assert ck.version == version and ck.storage_checksums is not None
    assert len(ck.storage_checksums) == len(ck.metadata.storage_data)
    for bad, kind in (({"layout": 1}, ValueError), ({"x": object()}, TypeError)):
        with pytest.raises(kind):
            save({"w": torch.ones(1)}, tmp_path / "bad", record=bad)
    with pytest.raises(ValueError, match="32 lowercase hex"):
        save({"w": torch.ones(1)}, tmp_path / "bad", token="x")
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------ load checks


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, opt = model_and_optim()
    train(model, opt, 1)
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    save(state_of(model, opt), path)
    return path


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("missing key", r"1 key\(s\) of the state dict are not in the checkpoint: 'model.extra'"),
        ("shape", r"'model.0.weight' has shape \(4, 8\) and dtype torch.float32 in the state"),
        ("dtype", r"'model.0.bias' has shape \(8,\) and dtype torch.float64"),
        ("tensor for a value", r"'step' is a tensor in the state dict but a non-tensor value"),
        ("value for a tensor", r"'model.2.bias' is a int in the state dict but a tensor"),
    ],
)
def test_a_state_dict_that_does_not_fit_is_refused_before_reading(
    saved: Path, edit: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkit.checkpoint._reader as reader

    def never(*args: Any) -> Any:
        raise AssertionError("a payload was read")

    monkeypatch.setattr(reader, "check_chunk", never)  # the first read of every tensor chunk
    dest = state_of(*model_and_optim(seed=1))
    if edit == "missing key":
        dest["model"]["extra"] = torch.zeros(1)
    elif edit == "shape":
        dest["model"]["0.weight"] = torch.zeros(4, 8)
    elif edit == "dtype":
        dest["model"]["0.bias"] = torch.zeros(8, dtype=torch.float64)
    elif edit == "tensor for a value":
        dest["step"] = torch.zeros(())
    else:
        dest["model"]["2.bias"] = 0
    with pytest.raises(CheckpointMismatchError, match=match):
        load(dest, saved)


def test_allow_partial_load_keeps_the_missing_keys(saved: Path) -> None:
    dest = state_of(*model_and_optim(seed=1))
    dest["model"]["extra"] = torch.full((2,), 7.0)
    load(dest, saved, allow_partial_load=True)
    assert torch.equal(dest["model"]["extra"], torch.full((2,), 7.0))


def test_damage_is_refused_naming_the_item(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    ck = open_checkpoint(path)
    want = state_of(*model_and_optim(seed=1))
    load(want, path)
    raw = want["model"]["2.weight"].numpy().tobytes()
    for f in ck.version.glob("*.distcp"):
        data = bytearray(f.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at] ^= 1
            f.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"item 'model.2.weight' \(file __0_0.distcp\) fails"):
        load(state_of(*model_and_optim(seed=1)), path)
    (ck.version / "SHARDKIT_COMMIT").write_bytes(b"")
    with pytest.raises(UnsafeCheckpointError, match=r"commit record\) is empty"):
        load(state_of(*model_and_optim(seed=1)), path)
    # opted out: structure and sizes are still checked, the bytes are not (logged)
    load(state_of(*model_and_optim(seed=1)), path, allow_missing_commit_record=True)
    with pytest.raises(CheckpointNotFoundError, match="is not a committed shardkit checkpoint"):
        load(want, tmp_path / "nothing")


# ------------------------------------------------------------------ crash safety


def _save_in_subprocess(path: Path, steps: int, crash_at: str) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(
        [sys.executable, str(_HERE / "_crash_save.py"), str(path), str(steps), crash_at],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    if res.returncode not in (0, 17):
        raise AssertionError(f"save subprocess failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res.returncode


_COMMIT_STEPS = ["written", "staged", "marked", "renamed", "pointed", "cleaned"]


@pytest.fixture(scope="module")
def one_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one_step")
    assert _save_in_subprocess(root / "ckpt", 1, "none") == 0
    return root / "ckpt"


@pytest.mark.parametrize("crash_at", _COMMIT_STEPS)
def test_crash_at_each_commit_step_leaves_old_or_new(
    crash_at: str, one_step: Path, tmp_path: Path
) -> None:
    """A save over a committed checkpoint killed at each step of its commit: the path always
    loads, verified, the old checkpoint until the pointer moved and the new one after."""
    path = tmp_path / "ckpt"
    shutil.copytree(one_step, path)
    assert _save_in_subprocess(path, 2, crash_at) == 17
    want = 2 if _COMMIT_STEPS.index(crash_at) >= _COMMIT_STEPS.index("pointed") else 1
    assert _steps(path) == want
    if crash_at == "marked":  # the next save cleans up what the crash left and commits
        assert _save_in_subprocess(path, 3, "none") == 0
        assert _steps(path) == 3
        assert sorted(os.listdir(path))[0] == "LATEST" and len(os.listdir(path)) == 2


@pytest.mark.parametrize("crash_at", ["written", "pointed", "rooted"])
def test_crash_during_the_first_save_leaves_nothing_or_everything(
    crash_at: str, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    assert _save_in_subprocess(path, 1, crash_at) == 17
    if crash_at == "rooted":
        assert _steps(path) == 1
    else:
        assert not path.exists()
    assert _save_in_subprocess(path, 2, "none") == 0
    assert _steps(path) == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_save_commits_nothing_and_leaves_nothing(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardkit.checkpoint._commit import Staging

    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    before = sorted(os.listdir(path))

    def crash(*args: Any) -> None:
        raise OSError("simulated failure before commit")

    monkeypatch.setattr(Staging, "commit", crash)
    with pytest.raises(CheckpointSaveError, match="nothing was committed: committing on rank 0"):
        save(state_of(*model_and_optim()), path)
    assert sorted(os.listdir(path)) == before  # the old version, untouched
    with pytest.raises(CheckpointSaveError, match="simulated failure"):
        save(state_of(*model_and_optim()), tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    monkeypatch.undo()
    (path / ".v-0123.tmp").mkdir()  # what a crashed save leaves
    (path / ".LATEST.tmp-0123").write_text("v-x\n")
    save(state_of(*model_and_optim()), path)
    assert sorted(os.listdir(path))[0] == "LATEST" and len(os.listdir(path)) == 2


# ------------------------------------------------------------------ across ranks


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared")


@world(2, timeout=120)
def test_replicated_state_saved_at_2_loads_at_1_and_2(shared: Path) -> None:
    """Plain DDP's case: every rank holds the whole state; rank-deduplicated by DCP."""
    model, opt = model_and_optim()
    train(model, opt, 2)
    save(state_of(model, opt), shared / "w2")
    dest = state_of(*model_and_optim(seed=1))
    load(dest, shared / "w2")
    assert_same(state_of(model, opt), dest)


@world(1, timeout=120)
def test_replicated_state_saved_at_2_loads_at_1(shared: Path) -> None:
    model, opt = model_and_optim()
    train(model, opt, 2)
    dest = state_of(*model_and_optim(seed=1))
    ck = load(dest, shared / "w2")
    assert ck.record is not None and ck.record["world_size"] == 2
    assert_same(state_of(model, opt), dest)


@world(2, timeout=120)
def test_a_failure_on_one_rank_raises_on_every_rank(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 alone fails its write / cannot see the checkpoint / holds a state dict that does
    not fit: every rank raises the same typed error naming rank 1, and stays in step."""
    import shardkit.checkpoint._commit as commit

    rank = dist.get_rank()
    state = state_of(*model_and_optim())

    def fail(name: str) -> None:
        if name == "written":
            raise OSError("simulated: disk full")

    if rank == 1:
        monkeypatch.setattr(commit, "crash_point", fail)
    with pytest.raises(CheckpointSaveError) as saving:
        save(state, tmp_path / "ckpt")
    assert "failed, nothing was committed: rank 1: OSError: simulated: disk full" in str(
        saving.value
    )
    assert not (tmp_path / "ckpt").exists()
    monkeypatch.undo()
    save(state, tmp_path / "ckpt")
    where = tmp_path / "ckpt" if rank == 0 else tmp_path / "not-here"
    with pytest.raises(CheckpointNotFoundError, match=r"on rank 1: .*not-here is not a committed"):
        load(state_of(*model_and_optim(seed=1)), where)
    dest = state_of(*model_and_optim(seed=1))
    if rank == 1:
        dest["model"]["0.weight"] = torch.zeros(2, 2)
    with pytest.raises(CheckpointMismatchError, match=r"'model.0.weight' has shape \(2, 2\)"):
        load(dest, tmp_path / "ckpt")
    messages: list[Any] = [None] * 2
    dist.all_gather_object(messages, str(saving.value))
    assert messages[0] == messages[1]
    load(state_of(*model_and_optim(seed=1)), tmp_path / "ckpt")  # still in step


@world(2, timeout=120)
def test_files_not_visible_to_the_committer_fail_the_save_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 writes to a directory rank 0 cannot see (no shared filesystem)."""
    import shardkit.checkpoint._api as api

    if dist.get_rank() == 1:
        private = tmp_path / "rank1-local"
        real = api._dcp_save

        def local_save(sd: Any, storage_writer: Any, **kw: Any) -> Any:
            private.mkdir(exist_ok=True)
            return real(sd, storage_writer=type(storage_writer)(private), **kw)

        monkeypatch.setattr(api, "_dcp_save", local_save)
    with pytest.raises(CheckpointSaveError, match=r"not visible .* from the rank committing it"):
        save(state_of(*model_and_optim()), tmp_path / "unshared")
    dist.barrier()
    assert not (tmp_path / "unshared").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".unshared")]


def test_a_none_destination_takes_the_stored_tensor(tmp_path: Path) -> None:
    """A record (or any plain tensor) whose size the caller cannot know: ``None`` in the state
    dict, nested or not, becomes the stored tensor; a damaged size is refused before."""
    from shardkit.checkpoint import from_record, to_record

    value = {"epoch": 3, "order": list(range(50)), "betas": (0.9, 0.95)}
    save({"w": torch.ones(3), "loader": {"state": to_record(value)}, "ids": torch.arange(7)},
         tmp_path / "ckpt")  # fmt: skip
    dest: dict[str, Any] = {"w": torch.empty(3), "loader": {"state": None}, "ids": None}
    load(dest, tmp_path / "ckpt")
    assert from_record(dest["loader"]["state"]) == value
    assert torch.equal(dest["ids"], torch.arange(7)) and dest["ids"].dtype == torch.int64
