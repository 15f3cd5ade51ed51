"""Checkpoints are data (issue 30) and the commit record is required (issue 26, item 8).

- shardkit's records are JSON; a format-1 checkpoint (pickled records) loads only with
  ``allow_pickle=True`` and re-saves in format 2 with bit-for-bit the same state;
- a hostile checkpoint (the normal writer plus one object whose ``__reduce__`` runs
  ``os.system``, in the header, the metadata, a payload) raises and the command never runs;
- DCP's ``.metadata`` goes through shardkit.checkpoint's allow-list unpickler (its own tests:
  ``packages/checkpoint/tests``);
- a checkpoint whose commit record is missing, empty or unreadable is refused on every rank;
  the opt-in still verifies every payload of a format-2 checkpoint.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _optim_testkit import assert_state_equal
from shardkit.optim import (
    ShardedOptimizer,
    UnsafeCheckpointError,
    load_consolidated,
    load_sharded,
    save_sharded,
)
from shardkit.testing import world
from torch import nn

_HERE = Path(__file__).resolve().parent
_V1 = _HERE / "data" / "v1"
_V2 = _HERE / "data" / "v2"  # format 2, written by shardkit-optim 0.3.2 at world 2 (writer.py)


class _Evil:
    """Unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _version(path: Path) -> Path:
    return path / (path / "LATEST").read_text().strip()


def _save_v2(path: Path, steps: int = 2) -> None:
    """A world-1 format-2 checkpoint of the reliability tests' model (a subprocess)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    store = path.parent / f"store-{uuid.uuid4().hex}"
    res = subprocess.run(
        [sys.executable, str(_HERE / "_crash_save.py"), str(path), str(steps), "none", str(store)],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("safety")
    _save_v2(root / "ckpt")
    return root / "ckpt"


def _write_v1(path: Path, extra: dict[str, Any] | None = None) -> None:
    """The format-1 writer of shardkit-optim <= 0.1.8 (one process): pickled header and
    param_groups, checksums in the commit record. ``extra`` goes into the pickled header."""
    from shardkit.checkpoint import checksum
    from shardkit.checkpoint._commit import Staging

    token = uuid.uuid4().hex
    staging = Staging(path, token)
    header: dict[str, Any] = {"format": "shardkit.optim.sharded/1", "num_params": 1}
    header.update({"world_size": 1, "token": token, **(extra or {})})
    sd: dict[str, Any] = {
        "param_groups": pickle.dumps([{"lr": 0.1, "momentum": 0.9, "params": [0]}]),
        "shardkit_optim": pickle.dumps(header),
        "state/0/momentum_buffer": torch.arange(3.0),
    }
    staging.prepare()
    dcp.save(sd, checkpoint_id=str(staging.stage), no_dist=True)
    record = {
        k: v for k, v in header.items() if k in ("format", "num_params", "world_size", "token")
    }
    record["param_shapes"] = [[3]]
    record["checksums"] = {k: checksum(v) for k, v in sd.items()}
    staging.commit(record)


# ---------------------------------------------------------------- hostile checkpoints


def test_hostile_header_never_runs(tmp_path: Path) -> None:
    """Normal writer + one object in the header whose __reduce__ calls os.system."""
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt"
    _write_v1(path, {"payload": _Evil(marker)})
    with pytest.raises(
        UnsafeCheckpointError, match=r"format shardkit\.optim\.sharded/1.*allow_pickle"
    ):
        load_consolidated(path)
    # the commit record edited to claim format 2: the pickled items are refused
    record = _version(path) / "SHARDKIT_COMMIT"
    record.write_text(record.read_text().replace("sharded/1", "sharded/2"))
    with pytest.raises(UnsafeCheckpointError, match=r"pickled object|is missing"):
        load_consolidated(path)
    # and with the commit record gone and opted out of, the format is still read as 1
    record.write_bytes(b"")
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle"):
        load_consolidated(path, allow_missing_commit_record=True)
    assert not marker.exists()


def test_hostile_metadata_and_payload_never_run(v2: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt"
    shutil.copytree(v2, path)
    meta = _version(path) / ".metadata"
    good = meta.read_bytes()
    meta.write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"global 'posix\.system' is not allowed"):
        load_consolidated(path)
    # the evil object nested deep inside otherwise valid metadata
    md = pickle.loads(good)
    md.planner_data = {"x": _Evil(marker)}
    meta.write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="is not allowed"):
        load_consolidated(path)
    assert not marker.exists()


# ---------------------------------------------------------------- format 1 -> 2


def _v1_model() -> tuple[nn.Module, ShardedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    ps = list(model.parameters())
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.02}]
    return model, ShardedOptimizer(groups, optim=torch.optim.Adam, lr=0.01, betas=(0.8, 0.99))


def _v2_model() -> ShardedOptimizer:
    """The model and optimizer of tests/data/v2/writer.py (bf16 params, fp32 masters)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(torch.bfloat16)
    ps = list(model.parameters())
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.02}]
    return ShardedOptimizer(
        groups, optim=torch.optim.Adam, lr=0.01, betas=(0.8, 0.99), master_dtype=torch.float32
    )


def test_format_2_of_an_earlier_release_loads(tmp_path: Path) -> None:
    """tests/data/v2 was written by save_sharded of shardkit-optim 0.3.2 (before
    shardkit-checkpoint: item CRC-32s only, no stored-chunk CRC-32s). It loads offline, is
    verified item by item (a flipped payload bit is refused), and the shardkit-checkpoint CLI
    verifies it against the same item CRC-32s."""
    want = torch.load(_V2 / "expected.pt", weights_only=True)
    assert_state_equal(want, load_consolidated(_V2 / "ckpt"))
    res = subprocess.run(
        [sys.executable, "-m", "shardkit.checkpoint", "verify", str(_V2 / "ckpt")],
        capture_output=True, text=True, timeout=120, check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert res.returncode == 0 and "CRC-32 of every item" in res.stdout, res.stdout + res.stderr
    damaged = tmp_path / "ckpt"
    shutil.copytree(_V2 / "ckpt", damaged)
    _flip_payload_bit(_version(damaged), want["state"][2]["exp_avg"].numpy().tobytes())
    with pytest.raises(ValueError, match=r"'state/2/exp_avg'.*fails its checksum"):
        load_consolidated(damaged)


@world(2, timeout=120)
def test_format_2_of_an_earlier_release_resumes_at_world_2(tmp_path: Path) -> None:
    """The same checkpoint into a sharded optimizer, then saved again by this release: both
    hold the saved state bit for bit."""
    want = torch.load(_V2 / "expected.pt", weights_only=True)
    opt = _v2_model()
    load_sharded(opt, _V2 / "ckpt")
    assert_state_equal(want, opt.state_dict(all_ranks=True))
    save_sharded(opt, tmp_path / "again")
    fresh = _v2_model()
    load_sharded(fresh, tmp_path / "again")
    assert_state_equal(want, fresh.state_dict(all_ranks=True))


def test_a_new_checkpoint_still_reads_as_format_2(v2: Path, tmp_path: Path) -> None:
    """What shardkit-optim 0.3 reads of a checkpoint this release writes: the commit record
    without shardkit-checkpoint's fields is a valid format-2 header, and the item CRC-32s of
    the header record alone verify every item (so a rollback can load it)."""
    import json

    from shardkit.optim._records import validate_header

    path = tmp_path / "ckpt"
    shutil.copytree(v2, path)
    record_file = _version(path) / "SHARDKIT_COMMIT"
    record = json.loads(record_file.read_text())
    assert record["layout"] == "shardkit.checkpoint/1" and record["storage_checksums"]
    old = {k: v for k, v in record.items() if k not in ("layout", "storage_checksums")}
    validate_header(old, "record")
    record_file.write_text(json.dumps(old))  # as 0.3 would see it: item CRC-32s only
    state = load_consolidated(path)
    assert state["state"] and state["param_groups"]
    _flip_payload_bit(_version(path), state["state"][0]["exp_avg"].numpy().tobytes())
    with pytest.raises(ValueError, match=r"'state/0/exp_avg'.*fails its checksum"):
        load_consolidated(path)


def test_format_1_loads_only_with_the_opt_in(tmp_path: Path) -> None:
    """The checkpoint in tests/data/v1 was written by save_sharded of shardkit-optim 0.1.8 (format 1)."""
    want = torch.load(_V1 / "expected.pt", weights_only=True)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        load_consolidated(_V1 / "ckpt")
    got = load_consolidated(_V1 / "ckpt", allow_pickle=True)
    assert_state_equal(want, got)
    assert got["param_groups"][0]["betas"] == (0.8, 0.99)


def test_a_0_1_checkpoint_needs_both_opt_ins(tmp_path: Path) -> None:
    """shardkit-optim 0.1's layout: files and an empty commit record directly in the path,
    pickled records. It loads only with both opt-ins (and then unverified, as documented)."""
    legacy = tmp_path / "legacy"
    shutil.copytree(_version(_V1 / "ckpt"), legacy)
    (legacy / "SHARDKIT_COMMIT").write_bytes(b"")
    with pytest.raises(ValueError, match=r"commit record\) is empty.*allow_missing_commit_record"):
        load_consolidated(legacy, allow_pickle=True)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        load_consolidated(legacy, allow_missing_commit_record=True)
    got = load_consolidated(legacy, allow_pickle=True, allow_missing_commit_record=True)
    assert_state_equal(torch.load(_V1 / "expected.pt", weights_only=True), got)


@world(2, timeout=120)
def test_format_1_resaved_as_format_2_bit_for_bit(tmp_path: Path) -> None:
    want = torch.load(_V1 / "expected.pt", weights_only=True)
    _, opt = _v1_model()
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        load_sharded(opt, _V1 / "ckpt")  # on every rank
    load_sharded(opt, _V1 / "ckpt", allow_pickle=True)
    save_sharded(opt, tmp_path / "v2")
    _, fresh = _v1_model()
    load_sharded(fresh, tmp_path / "v2")
    assert_state_equal(want, fresh.state_dict(all_ranks=True))
    if dist.get_rank() == 0:
        assert_state_equal(want, load_consolidated(tmp_path / "v2"))
        md = pickle.loads((_version(tmp_path / "v2") / ".metadata").read_bytes())
        kinds = {type(m).__name__ for m in md.state_dict_metadata.values()}
        assert kinds == {"TensorStorageMetadata"}, kinds  # nothing pickled of ours
    dist.barrier()


# ---------------------------------------------------------------- the commit record


def _flip_payload_bit(version: Path, raw: bytes) -> None:
    for f in sorted(version.glob("*.distcp")):
        data = bytearray(f.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at + len(raw) // 2] ^= 0x01
            f.write_bytes(bytes(data))
            return
    raise AssertionError("payload bytes not found")


def _small() -> tuple[nn.Module, ShardedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    return model, ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)


@world(2, timeout=120)
def test_emptied_commit_record_and_a_flipped_bit_raise_on_every_rank(tmp_path: Path) -> None:
    model, opt = _small()
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    path = tmp_path / "ckpt"
    save_sharded(opt, path)
    want = opt.state_dict(all_ranks=True)
    version = _version(path)
    if dist.get_rank() == 0:
        (version / "SHARDKIT_COMMIT").write_bytes(b"")
    dist.barrier()
    # empty record, payloads intact: refused by default, loads with the opt-in
    with pytest.raises(ValueError, match=r"commit record.*is empty"):
        load_sharded(_small()[1], path)
    ok = _small()[1]
    load_sharded(ok, path, allow_missing_commit_record=True)
    assert_state_equal(want, ok.state_dict(all_ranks=True))
    # one bit flipped in a payload: refused either way (the header record's checksums)
    if dist.get_rank() == 0:
        _flip_payload_bit(version, want["state"][2]["exp_avg"].numpy().tobytes())
    dist.barrier()
    with pytest.raises(ValueError, match=r"commit record.*is empty"):
        load_sharded(_small()[1], path)
    with pytest.raises(ValueError, match=r"'state/2/exp_avg'.*fails its checksum"):
        load_sharded(_small()[1], path, allow_missing_commit_record=True)
    # a deleted or garbled record
    if dist.get_rank() == 0:
        (version / "SHARDKIT_COMMIT").write_bytes(b"{not json")
    dist.barrier()
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_sharded(_small()[1], path)
    dist.barrier()
    if dist.get_rank() == 0:
        (version / "SHARDKIT_COMMIT").unlink()
    dist.barrier()
    with pytest.raises(FileNotFoundError, match=r"no commit record.*allow_missing_commit_record"):
        load_sharded(_small()[1], path)
    dist.barrier()


@world(1, timeout=120)
def test_hostile_header_from_the_current_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_sharded itself, with its header item replaced by an object whose __reduce__ runs
    os.system (the commit record and checksums are the writer's): refused with and without
    every opt-in, and the command never runs."""
    import shardkit.optim._checkpoint as ck

    marker = tmp_path / "pwned"
    real = ck.save  # shardkit.checkpoint.save, as save_sharded calls it

    def evil_save(sd: dict[str, Any], path: Any, **kw: Any) -> Any:
        return real({**sd, "shardkit/header": _Evil(marker)}, path, **kw)

    monkeypatch.setattr(ck, "save", evil_save)
    model, opt = _small()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    save_sharded(opt, tmp_path / "ckpt")
    for opts in ({}, {"allow_pickle": True, "allow_missing_commit_record": True}):
        with pytest.raises(
            UnsafeCheckpointError, match="'shardkit/header' is not a 1-D uint8 record"
        ):
            load_sharded(_small()[1], tmp_path / "ckpt", **opts)
        with pytest.raises(
            UnsafeCheckpointError, match="'shardkit/header' is not a 1-D uint8 record"
        ):
            load_consolidated(tmp_path / "ckpt", **opts)
    assert not marker.exists()


def test_cli_reads_a_format_1_checkpoint_only_with_allow_pickle(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "full.pt"

    def cli(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shardkit.optim", "consolidate", str(_V1 / "ckpt"), str(out),
             *flags],
            capture_output=True, text=True, timeout=120, check=False,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )  # fmt: skip

    refused = cli()
    assert refused.returncode == 2 and "allow_pickle" in refused.stderr, refused.stderr
    assert not out.exists()
    ok = cli("--allow-pickle")
    assert ok.returncode == 0, ok.stderr
    assert_state_equal(
        torch.load(_V1 / "expected.pt", weights_only=True), torch.load(out, weights_only=True)
    )


# ---------------------------------------------------------------- crafted stored chunks (issue 46)


def _forge_chunk(path: Path, how: str) -> None:
    """One stored tensor chunk of a format-2 checkpoint replaced as an attacker would, every
    CRC-32 of the commit record recomputed: ``legacy`` prefixes a sound ``torch.save`` zip with
    the legacy format's magic and a pickle bomb (torch.load would decode the prefix), ``link``
    makes its ``.distcp`` file a link to a copy outside the checkpoint."""
    import json
    import zlib

    from shardkit.checkpoint._unpickle import restricted_loads

    version = _version(path)
    md = restricted_loads((version / ".metadata").read_bytes(), "m")
    index = next(i for i in md.storage_data if i.offset is not None)
    info = md.storage_data[index]
    target = version / info.relative_path
    if how == "link":
        outside = path.parent / "outside.distcp"
        shutil.copy(target, outside)
        target.unlink()
        os.symlink(outside, target)
        return
    with open(target, "rb") as f:
        f.seek(info.offset)
        sound = f.read(info.length)
    # a dict keyed by a 60-deep billion-laughs tuple: hashing it takes 2**60 steps
    bomb = b"\x80\x02}X\x01\x00\x00\x00a\x85q\x00"
    bomb += b"".join(b"h" + bytes([i]) + b"\x86q" + bytes([i + 1]) for i in range(60)) + b"K\x01s."
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2)
    blob = magic + bomb + sound
    with open(target, "ab") as f:
        info.offset = f.tell()
        f.write(blob)
    info.length = len(blob)
    (version / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    record = json.loads((version / "SHARDKIT_COMMIT").read_text())
    for entry in record["storage_checksums"]:
        i = next(k for k in md.storage_data if k.fqn == entry[0] and (
            (k.offset is None and entry[1] is None) or list(k.offset or ()) == entry[1]))
        v = md.storage_data[i]
        with open(version / v.relative_path, "rb") as f:
            f.seek(v.offset)
            entry[2] = zlib.crc32(f.read(v.length))
    (version / "SHARDKIT_COMMIT").write_text(json.dumps(record))


@pytest.mark.parametrize("how", ["legacy", "link"])
def test_crafted_chunks_are_refused_by_load_consolidated(v2: Path, tmp_path: Path, how: str) -> None:
    import time

    path = tmp_path / "ckpt"
    shutil.copytree(v2, path)
    _forge_chunk(path, how)
    t0 = time.perf_counter()
    with pytest.raises(UnsafeCheckpointError, match="torch.save zip|symbolic link"):
        load_consolidated(path)
    assert time.perf_counter() - t0 < 2.0


@world(1, timeout=120)
def test_crafted_chunks_are_refused_by_load_sharded(v2: Path, tmp_path: Path) -> None:
    for how in ("legacy", "link"):
        path = tmp_path / how
        shutil.copytree(v2, path)
        _forge_chunk(path, how)
        with pytest.raises(UnsafeCheckpointError, match="torch.save zip|symbolic link"):
            load_sharded(_v2_model(), path)
