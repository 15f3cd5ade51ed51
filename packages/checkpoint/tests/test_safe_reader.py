"""``SafeFileSystemReader`` with plain ``torch.distributed.checkpoint`` (moved from
shardkit-optim): checkpoints written by ``dcp.save`` load; hostile ones (a ``__reduce__``
payload in the metadata or in a non-tensor item, file names outside the directory, storage
transforms, truncated files) raise and their code never runs; the allow-list unpickler reads
real DCP metadata back exactly (pinned on this torch and on a file of an earlier release).
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt_testkit import Evil, assert_same, model_and_optim, pickled, state_of, train
from shardkit.checkpoint import SafeFileSystemReader, UnsafeCheckpointError, save
from shardkit.checkpoint._unpickle import UnsafePickleError, restricted_loads
from torch.distributed.checkpoint.api import CheckpointException

_DATA = Path(__file__).resolve().parent / "data"


def _load(state: dict[str, Any], path: Path, **kw: Any) -> None:
    dcp.load(state, storage_reader=SafeFileSystemReader(path, **kw), no_dist=True)


def _refused(state: dict[str, Any], path: Path, match: str) -> None:
    with pytest.raises(CheckpointException) as info:  # DCP's wrapper (a BaseException)
        _load(state, path)
    assert match in str(info.value), str(info.value)[-2000:]


def test_plain_dcp_checkpoints_load(tmp_path: Path) -> None:
    """A model's and its optimizer's state saved by plain dcp.save (tensors, param groups with
    a tuple, ints, strings) loads through the safe reader exactly as through DCP's own."""
    model, opt = model_and_optim()
    train(model, opt, 2)
    want = state_of(model, opt)
    want["step"] = 2
    dcp.save(want, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    got = state_of(*model_and_optim(seed=1))
    _load(got, tmp_path / "ok")
    assert_same(want, got)
    assert got["optim"]["param_groups"][0]["betas"] == (0.8, 0.99)
    # DCP's checkpoint_id= resets the reader to the path
    again = state_of(*model_and_optim(seed=2))
    dcp.load(
        again,
        checkpoint_id=str(tmp_path / "ok"),
        storage_reader=SafeFileSystemReader(tmp_path / "elsewhere"),
        no_dist=True,
    )
    assert_same(want, again)


def test_hostile_non_tensor_item_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dcp.save(
        {"w": torch.randn(2), "evil": Evil(str(marker))},
        checkpoint_id=str(tmp_path / "bad"),
        no_dist=True,
    )
    _refused({"w": torch.empty(2), "evil": None}, tmp_path / "bad", "checkpoint item 'evil'")
    assert not marker.exists()
    # allow_pickle=True is the explicit opt-out for trusted checkpoints: then it runs
    _load({"w": torch.empty(2), "evil": None}, tmp_path / "bad", allow_pickle=True)
    assert marker.exists()


def test_hostile_metadata_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dcp.save({"w": torch.randn(2)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    meta = tmp_path / "c" / ".metadata"
    good = meta.read_bytes()
    meta.write_bytes(pickle.dumps(Evil(str(marker))))
    _refused({"w": torch.empty(2)}, tmp_path / "c", "global 'posix.system' is not allowed")
    md = pickle.loads(good)
    md.planner_data = {"x": Evil(str(marker))}  # nested deep inside otherwise valid metadata
    meta.write_bytes(pickle.dumps(md))
    _refused({"w": torch.empty(2)}, tmp_path / "c", "is not allowed")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("../../etc/passwd", "not a file of the checkpoint"),
        ("/etc/passwd", "not a file of the checkpoint"),
        ("transform", "storage transforms"),
        ("truncate", "the checkpoint is truncated"),
        ("overlap", "shares bytes"),
        ("length", "bytes stored in"),
    ],
)
def test_storage_entries_are_checked(tmp_path: Path, edit: str, match: str) -> None:
    """Every storage entry names a file of the directory, runs no DCP extension, and is
    backed by distinct bytes of a file long enough (see [Note: Disk-backed sizes])."""
    path = tmp_path / "c"
    dcp.save({"a": torch.randn(64), "b": torch.randn(64)}, checkpoint_id=str(path), no_dist=True)
    md = restricted_loads((path / ".metadata").read_bytes(), "m")
    infos = sorted(md.storage_data.items(), key=lambda kv: kv[0].fqn)
    (_, a), (kb, _) = infos
    if edit in ("../../etc/passwd", "/etc/passwd"):
        a.relative_path = edit
    elif edit == "transform":
        a.transform_descriptors = ["zstd"]
    elif edit == "truncate":
        f = path / a.relative_path
        f.write_bytes(f.read_bytes()[:-10])
    elif edit == "overlap":
        md.storage_data[kb] = a  # two items, the same bytes
    else:
        a.length = 10
    (path / ".metadata").write_bytes(pickled(md))
    _refused({"a": torch.empty(64), "b": torch.empty(64)}, path, match)


def test_reads_a_shardkit_checkpoint_and_checks_its_crcs(tmp_path: Path) -> None:
    """Given a directory written by shardkit.checkpoint.save, the reader follows LATEST and
    checks every stored chunk against its CRC-32 before torch.load sees it."""
    model, opt = model_and_optim()
    want = state_of(model, opt)
    version = save(want, tmp_path / "ckpt")
    got = state_of(*model_and_optim(seed=1))
    _load(got, tmp_path / "ckpt")
    assert_same(want, got)
    raw = want["model"]["0.weight"].numpy().tobytes()
    for f in version.glob("*.distcp"):
        data = bytearray(f.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at + 3] ^= 0x10
            f.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        _load(state_of(*model_and_optim(seed=1)), tmp_path / "ckpt")
    assert "ChecksumError: checkpoint item 'model.0.weight'" in str(info.value)
    assert "fails its checksum" in str(info.value)


def test_metadata_pin(tmp_path: Path) -> None:
    """Pins the allow-list unpickler on real DCP metadata (see [Note: Allow-list unpickling]):
    of this torch (a plain save, a shardkit save) and of an earlier release's checkpoint
    (tests/data/optim-0.1.8.metadata, written by shardkit-optim 0.1.8), read back equal to what
    pickle reads, through every protocol >= 2."""
    model, opt = model_and_optim()
    state = state_of(model, opt)
    dcp.save(state, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    version = save(state, tmp_path / "ckpt")
    for meta in (tmp_path / "plain" / ".metadata", version / ".metadata",
                 _DATA / "optim-0.1.8.metadata"):  # fmt: skip
        data = meta.read_bytes()
        want = pickle.loads(data)
        assert restricted_loads(data, "metadata") == want
        for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
            assert restricted_loads(pickle.dumps(want, protocol=proto), "m") == want


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00X\xff\xff\xff\x7fabc.", "truncated"),
        (b"\x80\x04K\x01r\xff\xff\xff\xff.", None),  # a huge memo index: a dict, not an array
        (b"\x80\x04cos\nsystem\n.", r"global 'os\.system'"),
        (b"(S'x'\nio\ns.", "opcode"),  # INST
        (b"\x80\x04P0\n.", "opcode"),  # PERSID
        (b"\x80\x04]K\x01a\x8c\x08builtins\x8c\x04eval\x93.", r"builtins\.eval"),
        (b"\x80\x04\x8c\x05torch\x8c\x0b__getattr__\x93.", "is not allowed"),  # no lazy import
        (b"\x80\x04(K\x01K\x02\x91.", None),  # a frozenset of ints: flat items are fine
        (b"\x80\x04}]\x94K\x01s.", "key of type list"),  # an unhashable key: refused, named
    ],
)
def test_unpickler_refuses(blob: bytes, message: str | None) -> None:
    if message is None:
        assert restricted_loads(blob, "m") in (1, frozenset({1, 2}))
        return
    with pytest.raises(UnsafePickleError, match=message):
        restricted_loads(blob, "m")
    assert issubclass(UnsafePickleError, UnsafeCheckpointError)


def test_build_runs_once_per_object(tmp_path: Path) -> None:
    """A second BUILD could change a MetadataIndex after it became a dict key."""
    dcp.save({"w": torch.randn(2)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    data = (tmp_path / "c" / ".metadata").read_bytes()
    md = restricted_loads(data, "m")
    shutil.rmtree(tmp_path / "c")
    twice = pickled(md)[:-1] + b"}\x8c\x07versionNsb."  # BUILD {"version": None} again
    with pytest.raises(UnsafePickleError, match="BUILD twice"):
        restricted_loads(twice, "m")
