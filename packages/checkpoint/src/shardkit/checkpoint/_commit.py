"""The on-disk layout of a checkpoint: versioned directories behind an atomic pointer.

[Note: Atomic commit]
A checkpoint at ``<path>`` is a directory holding committed versions and one pointer::

    <path>/LATEST            the name of the committed version (one line), replaced atomically
    <path>/v-<token>/        DCP files + SHARDKIT_COMMIT (the commit record: JSON, CRC-32s)

A save never writes into a committed version. It stages ``<path>/.v-<token>.tmp`` (DCP files,
then the commit record, fsynced), renames it to ``v-<token>``, writes ``.LATEST.tmp-<token>``
and ``os.replace``-s it over ``LATEST`` (the commit point; both renames are atomic on POSIX
filesystems), then deletes the versions ``LATEST`` no longer names. The first save stages a
whole ``<parent>/.<name>.tmp-<token>`` directory (version and pointer) and renames it to
``<path>``, so ``<path>`` never exists without a loadable checkpoint in it. A crash at any
instant therefore leaves ``<path>`` absent (first save) or pointing at the old or the new
version, complete. Directories a crashed save left behind are removed by the next save to the
same path; a failed save removes its own. Loading reads ``LATEST``; a checkpoint written by
shardkit-optim 0.1 (DCP files and commit record directly in ``<path>``) still resolves, and
the first save over it converts it.

[Note: Checkpoint checksums]
After DCP wrote them, every rank reads back the bytes of every item it wrote (each stored chunk:
a ``torch.save`` blob at an offset of a file) and computes their CRC-32; the coordinator gathers
them into the commit record's ``storage_checksums``. A load checks the CRC-32 of every stored
chunk it reads before ``torch.load`` sees its bytes and raises ``ChecksumError`` naming the item
and the file on a mismatch (silent corruption: flipped or overwritten bytes, files of two saves
mixed); every stored chunk of the metadata must have a CRC-32 and every CRC-32 a stored chunk.
Because the CRC covers stored bytes, not loaded tensors, it holds whatever a load reshards to.
Before committing, the coordinator also checks that every file DCP's metadata refers to is
visible to it with at least the bytes the metadata needs: a rank whose files went to a
directory the coordinator cannot see (no shared filesystem) fails the save on every rank instead
of committing an unloadable checkpoint. CRC-32 detects damage, not tampering (see
``docs/security.md``).
"""

from __future__ import annotations

import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import CheckpointNotFoundError, UnsafeCheckpointError
from shardkit.checkpoint._fs import Location, as_location
from shardkit.checkpoint._metadata import read_safe_metadata
from shardkit.checkpoint._records import dumps_json, loads_json, tensor_bytes

__all__ = [
    "LAYOUT",
    "MARKER",
    "POINTER",
    "Staging",
    "StorageKey",
    "checksum",
    "crash_point",
    "crc32_range",
    "read_commit_record",
    "resolve",
    "resolve_location",
    "storage_checksums",
    "storage_key",
    "verify_files",
]

MARKER = "SHARDKIT_COMMIT"
POINTER = "LATEST"
LAYOUT = "shardkit.checkpoint/1"
"""The commit record's ``layout``: the fields this module writes and reads (see
:func:`read_commit_record`)."""
_VERSION = re.compile(r"^v-[0-9a-f]{32}$")
_TOKEN = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 1 << 22


def crash_point(name: str) -> None:
    """Test hook: called between the steps of a save (tests kill the process here)."""


def checksum(value: torch.Tensor | bytes | bytearray) -> int:
    """CRC-32 of a tensor's bytes (any dtype, any device) or of a bytes blob.

    Raises:
        TypeError: ``value`` is neither.
    """
    if isinstance(value, torch.Tensor):
        return zlib.crc32(tensor_bytes(value))
    if isinstance(value, (bytes, bytearray)):
        return zlib.crc32(value)
    raise TypeError(
        f"checksum() takes a tensor or bytes, got {type(value).__name__}: store other values as "
        f"records (shardkit.checkpoint.to_record)"
    )


def crc32_range(path: Path, offset: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of a file from ``offset``, read 4 MiB at a time.

    Raises:
        OSError: the file cannot be read, or is shorter.
    """
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            data = f.read(min(left, _CHUNK))
            if not data:
                raise OSError(f"{path} ends {left} bytes before offset {offset} + {length}")
            crc = zlib.crc32(data, crc)
            left -= len(data)
    return crc


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class Staging:
    """Where one save writes, and how it commits. Built identically on every rank."""

    def __init__(self, final: Path, token: str) -> None:
        self.final = final
        self.token = token
        self.version = f"v-{token}"
        self.fresh = not (final / POINTER).is_file()  # no committed versioned checkpoint yet
        self.legacy = self.fresh and (final / MARKER).is_file()
        if self.fresh and not self.legacy:
            self.root = final.parent / f".{final.name}.tmp-{token}"
        else:
            self.root = final
        self.stage = self.root / f".{self.version}.tmp"

    def prepare(self) -> None:
        """Coordinator: removes what crashed saves left, creates the staging directory."""
        remove_leftovers(self.final)
        self.stage.mkdir(parents=True, exist_ok=False)

    def commit(self, record: dict[str, Any]) -> None:
        """Coordinator, after every rank's DCP files are written. See [Note: Atomic commit]."""
        verify_files(self.stage)
        crash_point("staged")
        _write_durably(self.stage / MARKER, dumps_json(record))
        crash_point("marked")
        os.rename(self.stage, self.root / self.version)
        _fsync_dir(self.root)
        crash_point("renamed")
        pointer_tmp = self.root / f".{POINTER}.tmp-{self.token}"
        _write_durably(pointer_tmp, self.version + "\n")
        os.replace(pointer_tmp, self.root / POINTER)
        _fsync_dir(self.root)
        crash_point("pointed")
        if self.root != self.final:
            os.rename(self.root, self.final)  # first save: the whole checkpoint appears at once
            _fsync_dir(self.final.parent)
            crash_point("rooted")
        remove_old_versions(self.final, keep=self.version)
        crash_point("cleaned")

    def abort(self) -> None:
        """Coordinator, after a failure: removes this save's staging (never a committed one)."""
        shutil.rmtree(self.stage, ignore_errors=True)
        if self.root != self.final:
            shutil.rmtree(self.root, ignore_errors=True)


def remove_leftovers(final: Path) -> None:
    """Removes staging directories and pointer temps that earlier crashed saves left."""
    if final.parent.is_dir():
        for p in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)
        for p in final.parent.glob(f".{final.name}.old-*"):  # the 0.1 commit's aside copies
            shutil.rmtree(p, ignore_errors=True)
    if (final / POINTER).is_file():
        for p in final.glob(".v-*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
        for p in final.glob(f".{POINTER}.tmp-*"):
            p.unlink(missing_ok=True)


def remove_old_versions(final: Path, keep: str) -> None:
    """Deletes every version but ``keep``, and files of the 0.1 layout."""
    for p in final.iterdir():
        if p.name == keep or p.name == POINTER:
            continue
        if _VERSION.match(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file() and (p.name in (MARKER, ".metadata") or p.name.endswith(".distcp")):
            p.unlink(missing_ok=True)  # a converted 0.1 checkpoint


def resolve(path: Path, require_marker: bool = True) -> Path:
    """The committed version directory of the checkpoint at ``path`` (see
    :func:`resolve_location`)."""
    return resolve_location(path, require_marker).path


def resolve_location(path: str | os.PathLike[str], require_marker: bool = True) -> Location:
    """The committed version directory of the checkpoint at ``path``, as a :class:`Location`
    below it (nothing below ``path`` followed as a link: see [Note: No path leaves the
    checkpoint]).

    Args:
        path: the checkpoint directory.
        require_marker: the version must hold its commit record (see [Note: Commit record
            required]); ``False`` accepts a version the pointer names that lost it.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        UnsafeCheckpointError: ``LATEST``, the version or its commit record is a link.
    """
    root = as_location(path)
    path = root.path
    if root.is_file(POINTER):
        name = root.read(POINTER, 128).decode("utf-8", "replace").strip()  # a name: 34 bytes
        if not _VERSION.match(name) or not root.is_dir(name):
            raise CheckpointNotFoundError(
                f"{path}/{POINTER} names {describe(name)}, which is not a version there; the "
                f"checkpoint directory was modified by hand or is damaged"
            )
        version = root.child(name)
        if require_marker and not version.is_file(MARKER):
            raise CheckpointNotFoundError(
                f"{version} has no commit record ({MARKER}): the checkpoint is damaged (its "
                f"payloads cannot be verified against it). Pass "
                f"allow_missing_commit_record=True to load it anyway (see its docstring)."
            )
        return version
    if root.is_file(MARKER):
        return root  # written by shardkit-optim 0.1
    raise CheckpointNotFoundError(
        f"{path} is not a committed shardkit checkpoint: it has neither a {POINTER} pointer nor "
        f"a {MARKER} commit record (a save to it never completed, or it was not written by a "
        f"shardkit save)."
    )


# [Note: Commit record required]
# The commit record (``SHARDKIT_COMMIT``) carries the CRC-32 of every stored chunk. A load
# refuses a version whose record is missing, empty, not JSON or not a valid record: with it
# gone nothing would tell a damaged payload from a good one (shardkit-optim 0.1 read an empty
# record as "no checksums" and loaded corrupted state silently).
# ``allow_missing_commit_record=True`` loads such a checkpoint unverified, logging a warning
# (shardkit-optim's format 2 is then still verified item by item against the checksums its own
# ``shardkit/header`` record carries: see its [Note: Optimizer checkpoint records]).
def read_commit_record(version: Location | str | os.PathLike[str]) -> dict[str, Any]:
    """The commit record of a version, its ``layout`` fields checked.

    A record of layout :data:`LAYOUT` holds ``token`` (32 hex digits: the save's id, also the
    version's name), ``world_size`` and ``storage_checksums`` (``[fqn, offsets or null,
    crc32]`` for every stored chunk), plus the fields of whoever saved (e.g. shardkit-optim's
    ``format`` and param shapes). A record without ``layout`` (shardkit-optim 0.3 and earlier)
    is returned as it is, for its writer's code to check.

    Raises:
        UnsafeCheckpointError: the record is missing, empty, not JSON, not an object, or a
            ``layout`` field is malformed. See [Note: Commit record required].
    """
    where = as_location(version)
    marker = where.path / MARKER
    hint = (
        "the checkpoint is damaged; pass allow_missing_commit_record=True to load it anyway "
        "(see its docstring for what is then verified)"
    )
    if not where.is_file(MARKER):  # absent, or a FIFO/device that would block
        raise UnsafeCheckpointError(f"{marker} (the commit record) is not a regular file; {hint}")
    try:
        raw = where.read(MARKER)
    except OSError as e:
        raise UnsafeCheckpointError(
            f"{marker} cannot be read ({type(e).__name__}: {e}); {hint}"
        ) from None
    if not raw.strip():
        raise UnsafeCheckpointError(f"{marker} (the commit record) is empty; {hint}")
    try:
        data = loads_json(raw, str(marker))
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{e}; {hint}") from None
    if type(data) is not dict:
        raise UnsafeCheckpointError(f"{marker} does not hold a JSON object; {hint}")
    if "layout" in data:
        _check_layout(data, str(marker))
    return data


def _bad(what: str, field: str, value: Any, expected: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{what}: field {field!r} is {describe(value)}, expected {expected}; the checkpoint is "
        f"damaged or crafted"
    )


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _check_layout(record: dict[str, Any], what: str) -> None:
    if record["layout"] != LAYOUT:
        raise _bad(what, "layout", record["layout"], f"{LAYOUT!r} (a newer shardkit-checkpoint?)")
    token = record.get("token")
    if type(token) is not str or not _TOKEN.match(token):
        raise _bad(what, "token", token, "32 hex digits")
    if not _is_int(record.get("world_size"), 1, 1 << 24):
        raise _bad(what, "world_size", record.get("world_size"), "an int >= 1")
    sums = record.get("storage_checksums")
    if type(sums) is not list:
        raise _bad(what, "storage_checksums", sums, "a list of [item, offsets, crc32]")
    for entry in sums:
        ok = type(entry) is list and len(entry) == 3 and type(entry[0]) is str
        offsets = entry[1] if ok else None
        ok = ok and (
            offsets is None
            or (type(offsets) is list and all(_is_int(d, 0, 1 << 62) for d in offsets))
        )
        if not ok or not _is_int(entry[2], 0, 0xFFFFFFFF):
            raise _bad(what, "storage_checksums", entry, "[item name, offsets or null, crc32]")


def storage_key(fqn: str, offsets: Any) -> StorageKey:
    """The key of a stored chunk in ``storage_checksums``: its item and chunk offsets."""
    return fqn, None if offsets is None else tuple(int(d) for d in offsets)


StorageKey = tuple[str, tuple[int, ...] | None]
"""A stored chunk: its item's name and the chunk's offsets (``None`` for a non-tensor item)."""


def storage_checksums(record: dict[str, Any] | None) -> dict[StorageKey, int] | None:
    """``storage_checksums`` of a record read by :func:`read_commit_record` as a dict, or None
    (no record, or a record of shardkit-optim 0.3 and earlier)."""
    if record is None or "layout" not in record:
        return None
    return {storage_key(e[0], e[1]): e[2] for e in record["storage_checksums"]}


def verify_files(stage: Path) -> None:
    """Every file the DCP metadata refers to is here with enough bytes. See [Note: Checkpoint
    checksums]."""
    metadata = read_safe_metadata(stage)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = str(info.relative_path)
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    missing = []
    for rel, size in sorted(needed.items()):
        f = stage / rel
        have = f.stat().st_size if f.is_file() else -1
        if have < size:
            missing.append(f"{rel} ({'absent' if have < 0 else f'{have} of {size} bytes'})")
    if missing:
        raise OSError(
            f"{len(missing)} file(s) of this checkpoint are not visible in {stage} from the "
            f"rank committing it: {missing[:5]}. Every rank must write to the same shared "
            f"filesystem path (a node-local directory on another host is not visible here)."
        )
