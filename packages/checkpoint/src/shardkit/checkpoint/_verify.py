"""Inspecting and verifying a checkpoint offline, without loading it into a model.

:func:`inspect` lists what a checkpoint holds from its metadata and commit record (no payload is
read); :func:`verify` reads every stored chunk once, streaming, and checks it as a load would
(CRC-32, zip structure, the pickle decoded by the allow-list; non-tensor items decoded whole), so
a damaged checkpoint is found before a job restarts from it. Both open the checkpoint with
:func:`open_checkpoint` (see [Note: Safe DCP reading]).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.checkpoint._api import Checkpoint, open_checkpoint
from shardkit.checkpoint._commit import checksum, storage_key
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import ChecksumError, UnsafeCheckpointError
from shardkit.checkpoint._metadata import numel
from shardkit.checkpoint._payload import decode_blob
from shardkit.checkpoint._reader import check_chunk, chunk_index, read_span
from shardkit.checkpoint._scan import decode_object
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

__all__ = ["VerifyReport", "inspect", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked."""

    version: Path
    """The committed version directory."""
    items: int
    """Items of the checkpoint (a tensor or a non-tensor value each)."""
    chunks: int
    """Stored chunks read and checked."""
    nbytes: int
    """Bytes read."""
    checksums: str
    """What the bytes were checked against: ``"storage"`` (the CRC-32 of every stored chunk),
    ``"items"`` (shardkit-optim 0.3 and earlier: the CRC-32 of every whole item) or ``"none"``
    (no commit record: structure and sizes only)."""


def inspect(
    path: str | os.PathLike[str], *, allow_missing_commit_record: bool = False
) -> dict[str, Any]:
    """What the checkpoint at ``path`` holds, from its metadata and commit record only.

    Returns:
        ``{"path", "version", "layout", "token", "world_size", "record", "items",
        "total_bytes"}``: ``record`` maps each other field of the commit record to a bounded
        description of its value; ``items`` lists ``{"key", "kind" ("tensor" / "object"),
        "dtype", "shape", "chunks", "bytes"}`` per item, sorted by key.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        UnsafeCheckpointError: as for :func:`open_checkpoint`.
    """
    ck = open_checkpoint(path, allow_missing_commit_record=allow_missing_commit_record)
    md = ck.metadata
    items: list[dict[str, Any]] = []
    total = 0
    for key in sorted(md.state_dict_metadata):
        item = md.state_dict_metadata[key]
        if isinstance(item, TensorStorageMetadata):
            nbytes = numel(item.size) * item.properties.dtype.itemsize
            entry = {
                "key": key,
                "kind": "tensor",
                "dtype": str(item.properties.dtype).removeprefix("torch."),
                "shape": list(item.size),
                "chunks": len(item.chunks),
                "bytes": nbytes,
            }
        else:
            nbytes = int(md.storage_data[MetadataIndex(key)].length)
            entry = {"key": key, "kind": "object", "dtype": None, "shape": None, "chunks": 1,
                     "bytes": nbytes}  # fmt: skip
        total += nbytes
        items.append(entry)
    record = ck.record or {}
    return {
        "path": str(ck.path),
        "version": str(ck.version),
        "layout": record.get("layout") if type(record.get("layout")) is str else None,
        "token": record.get("token") if type(record.get("token")) is str else None,
        "world_size": record.get("world_size") if type(record.get("world_size")) is int else None,
        "record": {
            k: describe(v)
            for k, v in record.items()
            if k not in ("layout", "token", "world_size", "storage_checksums", "checksums")
        },
        "items": items,
        "total_bytes": total,
    }


def _item_checksums(ck: Checkpoint) -> dict[str, int] | None:
    sums = (ck.record or {}).get("checksums")
    if type(sums) is not dict:
        return None
    for k, v in sums.items():
        if type(k) is not str or type(v) is not int or not 0 <= v <= 0xFFFFFFFF:
            raise UnsafeCheckpointError(
                f"{ck.version}: the commit record's checksum {describe(k)}: {describe(v)} is "
                f"not an item name and a CRC-32; the checkpoint is damaged or crafted"
            )
    return dict(sums)


def _read(ck: Checkpoint, index: MetadataIndex) -> bytearray:
    info = ck.metadata.storage_data[index]
    with ck.location.open(info.relative_path) as f:  # see [Note: No path leaves the checkpoint]
        return read_span(f, info.offset, info.length, f"{ck.version}/{info.relative_path}")


def _verify_item_checksums(ck: Checkpoint, sums: dict[str, int]) -> int:
    """shardkit-optim <= 0.3: the CRC-32 of each whole item (tensor bytes, or the bytes of a
    pickled record), loaded one at a time (after the checks of every chunk). Returns bytes."""
    md = ck.metadata
    total = 0
    for key, want in sorted(sums.items()):
        item = md.state_dict_metadata.get(key)
        what = f"checkpoint item {describe(key)}"
        if item is None:
            raise UnsafeCheckpointError(f"{what} has a checksum but is not in the metadata")
        if isinstance(item, TensorStorageMetadata):
            if len(item.chunks) != 1:
                raise UnsafeCheckpointError(f"{what} has {len(item.chunks)} chunks, not one")
            blob = _read(ck, MetadataIndex(key, item.chunks[0].offsets))
            got = checksum(decode_blob(blob, len(blob), what, tensor=True))
        else:
            blob = _read(ck, MetadataIndex(key))
            value = decode_object(blob, what)
            if not isinstance(value, (bytes, bytearray)):
                raise UnsafeCheckpointError(f"{what} is not a record of bytes")
            got = zlib.crc32(value)
        total += len(blob)
        if got != want:
            raise ChecksumError(
                f"{what} fails its checksum (crc32 {got:#010x}, saved {want:#010x}): the file "
                f"was modified or corrupted after the save"
            )
    return total


def verify(
    path: str | os.PathLike[str], *, allow_missing_commit_record: bool = False
) -> VerifyReport:
    """Reads every stored chunk of the checkpoint at ``path`` once and checks it as a load
    would, without a model: the CRC-32s of the commit record, each tensor's ``torch.save``
    structure and declared sizes, each non-tensor item through the weights-only loader.
    Streams tensor chunks (memory: one non-tensor item at a time).

    Args:
        path: the checkpoint directory.
        allow_missing_commit_record: check a version without its commit record (structure and
            sizes only: ``checksums="none"``).

    Returns:
        What was checked.

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        UnsafeCheckpointError: (``ChecksumError`` for a CRC-32 mismatch) the first damaged or
            crafted item, naming it and its file.
    """
    ck = open_checkpoint(path, allow_missing_commit_record=allow_missing_commit_record)
    md = ck.metadata
    sums = ck.storage_checksums
    chunks = chunk_index(md)
    nbytes = 0
    order = sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))
    for index, info in order:
        key = storage_key(index.fqn, index.offset)
        want = None if sums is None else sums[key]
        item = md.state_dict_metadata[index.fqn]
        if isinstance(item, TensorStorageMetadata):
            check_chunk(ck.location, md, index, want, chunks)
        else:
            what = f"checkpoint item {describe(index.fqn)} (file {info.relative_path})"
            blob = _read(ck, index)
            if want is not None and zlib.crc32(blob) != want:
                raise ChecksumError(
                    f"{what} fails its checksum (crc32 {zlib.crc32(blob):#010x}, saved "
                    f"{want:#010x}): the file was modified or corrupted after the save"
                )
            decode_object(blob, what)
        nbytes += int(info.length)
    kind = "storage"
    if sums is None:
        legacy = _item_checksums(ck)
        kind = "none" if legacy is None else "items"
        if legacy is not None:
            _verify_item_checksums(ck, legacy)
    return VerifyReport(ck.version, len(md.state_dict_metadata), len(order), nbytes, kind)
