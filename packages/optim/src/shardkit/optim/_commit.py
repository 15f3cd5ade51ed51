"""The on-disk layout of a sharded checkpoint: versioned directories behind an atomic pointer.

[Note: Atomic commit]
A checkpoint at ``<path>`` is a directory holding committed versions and one pointer::

    <path>/LATEST            the name of the committed version (one line), replaced atomically
    <path>/v-<token>/        DCP files + SHARDKIT_COMMIT (header, per-item checksums)

A save never writes into a committed version. It stages ``<path>/.v-<token>.tmp`` (DCP files,
then the marker, fsynced), renames it to ``v-<token>``, writes ``.LATEST.tmp-<token>`` and
``os.replace``-s it over ``LATEST`` (the commit point; both renames are atomic on POSIX
filesystems), then deletes the versions ``LATEST`` no longer names. The first save stages a
whole ``<parent>/.<name>.tmp-<token>`` directory (version and pointer) and renames it to
``<path>``, so ``<path>`` never exists without a loadable checkpoint in it. A crash at any
instant therefore leaves ``<path>`` absent (first save) or pointing at the old or the new
version, complete. Directories a crashed save left behind are removed by the next save to the
same path; a failed save removes its own. Loading reads ``LATEST``; a checkpoint written by
shardkit-optim 0.1 (DCP files and marker directly in ``<path>``) still loads (through the
opt-ins of [Note: Commit record required]: its record is empty and its records pickled), and
the first save over it converts it.

[Note: Checkpoint checksums]
Every rank computes a CRC-32 of every item it writes (tensor bytes) before DCP writes them;
every rank gathers them into the ``shardkit/header`` record and the coordinator writes them
into the marker (with the header record's own). A load recomputes the CRC of every item it
read and raises naming the item, the rank and the file on a mismatch (silent corruption:
flipped or overwritten bytes in a payload), or on an item without a saved CRC, on every rank;
every saved item must be in the metadata. Before committing, the coordinator also checks
that every file DCP's metadata refers to is visible to it with at least the bytes the metadata
needs: a rank whose files went to a directory the coordinator cannot see (no shared
filesystem) fails the save on every rank instead of committing an unloadable checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__: list[str] = []

MARKER = "SHARDKIT_COMMIT"
POINTER = "LATEST"
_VERSION = re.compile(r"^v-[0-9a-f]{32}$")


def crash_point(name: str) -> None:
    """Test hook: called between the steps of a commit (tests kill the process here)."""


def checksum(value: object) -> int:
    """CRC-32 of a tensor's bytes (any dtype, any device) or of a bytes blob."""
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(-1)
        if t.device.type != "cpu":
            t = t.cpu()
        data = t.contiguous().view(torch.uint8).numpy()
        return zlib.crc32(data.data)
    if isinstance(value, (bytes, bytearray)):
        return zlib.crc32(value)
    return zlib.crc32(repr(value).encode())


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

    def commit(self, header: dict[str, Any]) -> None:
        """Coordinator, after every rank's DCP files are written. See [Note: Atomic commit]."""
        verify_files(self.stage)
        crash_point("staged")
        _write_durably(self.stage / MARKER, json.dumps(header))
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
    """The committed version directory of the checkpoint at ``path``.

    Args:
        path: the checkpoint directory.
        require_marker: the version must hold its commit record (see [Note: Commit record
            required]); ``False`` accepts a version the pointer names that lost it.

    Raises:
        FileNotFoundError: ``path`` holds no committed checkpoint.
    """
    pointer = path / POINTER
    if pointer.is_file():
        name = pointer.read_text(errors="replace").strip()
        version = path / name
        if not _VERSION.match(name) or not version.is_dir():
            raise FileNotFoundError(
                f"{path}/{POINTER} names {name[:80]!r}, which is not a version there; the "
                f"checkpoint directory was modified by hand or is damaged"
            )
        if require_marker and not (version / MARKER).is_file():
            raise FileNotFoundError(
                f"{version} has no commit record ({MARKER}): the checkpoint is damaged (its "
                f"payloads cannot be verified against it). Pass "
                f"allow_missing_commit_record=True to load it anyway (see its docstring)."
            )
        return version
    if (path / MARKER).is_file():
        return path  # written by shardkit-optim 0.1
    raise FileNotFoundError(
        f"{path} is not a committed shardkit.optim checkpoint: it has neither a {POINTER} "
        f"pointer nor a {MARKER} marker (a save to it never completed, or it was not written "
        f"by save_sharded)."
    )


# [Note: Commit record required]
# The commit record (``SHARDKIT_COMMIT``) carries the checksum of every item. A load refuses a
# version whose record is missing, empty, not JSON or not a valid header: with it gone nothing
# would tell a damaged payload from a good one (shardkit-optim 0.1 read an empty record as "no
# checksums" and loaded corrupted state silently). ``allow_missing_commit_record=True`` loads
# such a checkpoint; a format-2 checkpoint is then still verified item by item against the
# checksums its ``shardkit/header`` record carries (see [Note: Checkpoint records]), only that
# record itself is checked by its schema alone; a format-1 checkpoint (or a 0.1 one, whose
# record is empty) has no other checksums and loads unverified.
def read_header(version: Path) -> dict[str, Any]:
    """The commit record's JSON object (header fields and ``checksums``).

    Raises:
        ValueError: the record is missing, empty, not JSON or not a JSON object. See
            [Note: Commit record required].
    """
    marker = version / MARKER
    hint = (
        "the checkpoint is damaged; pass allow_missing_commit_record=True to load it anyway "
        "(see its docstring for what is then verified)"
    )
    if not marker.is_file():  # absent, or a FIFO/device that would block
        raise ValueError(f"{marker} (the commit record) is not a regular file; {hint}")
    try:
        raw = marker.read_bytes()
    except OSError as e:
        raise ValueError(f"{marker} cannot be read ({type(e).__name__}: {e}); {hint}") from None
    if not raw.strip():
        raise ValueError(f"{marker} (the commit record) is empty; {hint}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{marker} is not valid JSON ({str(e)[:100]}); {hint}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{marker} does not hold a JSON object; {hint}")
    return data


def verify_files(stage: Path) -> None:
    """Every file the DCP metadata refers to is here with enough bytes. See the Note."""
    from shardkit.optim._safe_reader import read_safe_metadata

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


def verify_checksums(
    loaded: dict[str, Any],
    expected: dict[str, int],
    where: Callable[[str], str],
    strict: bool = False,
) -> str | None:
    """The first item of ``loaded`` whose CRC differs from ``expected`` (or, with ``strict``,
    that has no saved CRC), described; else None."""
    for key, value in loaded.items():
        want = expected.get(key)
        if want is None and strict and isinstance(value, torch.Tensor):
            return f"item {key!r} ({where(key)}) has no saved checksum: it was not part of the save"
        if want is None or value is None:
            continue
        got = checksum(value)
        if got != want:
            return (
                f"item {key!r} ({where(key)}) fails its checksum (crc32 {got:#010x}, saved "
                f"{want:#010x}): the file was modified or corrupted after the save"
            )
    return None
