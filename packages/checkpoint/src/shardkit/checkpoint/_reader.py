"""``SafeFileSystemReader``: a DCP storage reader that reads a checkpoint as data.

What it checks, and when: [Note: Safe DCP reading] in ``_metadata.py``.
"""

from __future__ import annotations

import io
import logging
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from shardkit.checkpoint._commit import (
    MARKER,
    POINTER,
    StorageKey,
    read_commit_record,
    resolve,
    storage_checksums,
    storage_key,
)
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import ChecksumError, UnsafeCheckpointError
from shardkit.checkpoint._metadata import (
    check_storage,
    chunk_nbytes,
    read_safe_metadata,
    validate_metadata,
)
from shardkit.checkpoint._scan import check_tensor_pickle, decode_object, open_blob
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = ["SafeFileSystemReader", "check_checksum_keys", "check_chunk"]

logger = logging.getLogger("shardkit.checkpoint")


class _FileSlice(io.RawIOBase):
    """``length`` bytes of an open file from ``offset``, seekable: what ``zipfile`` reads a
    stored blob through without holding it in memory."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _crc(f: IO[bytes], offset: int, length: int) -> int:
    crc, left = 0, length
    f.seek(offset)
    while left:
        data = f.read(min(left, 1 << 22))
        if not data:
            break
        crc = zlib.crc32(data, crc)
        left -= len(data)
    return crc


def check_checksum_keys(metadata: Metadata, sums: Mapping[StorageKey, int], what: str) -> None:
    """Every stored chunk of the metadata has a CRC-32, and every CRC-32 a stored chunk.

    Raises:
        ChecksumError: naming the first chunk without its counterpart.
    """
    stored = {storage_key(k.fqn, k.offset) for k in metadata.storage_data}
    if stored != set(sums):
        extra = sorted(stored ^ set(sums), key=str)[0]
        raise ChecksumError(
            f"{what}: the stored chunks and the CRC-32s of the commit record do not match "
            f"(first: {describe(extra[0])}): files of two saves were mixed, or the metadata was "
            f"modified"
        )


def check_chunk(
    directory: Path,
    md: Metadata,
    index: MetadataIndex,
    expected_crc: int | None,
) -> None:
    """Checks one stored tensor chunk before ``torch.load`` reads it: its CRC-32 (when known),
    its zip records and the integers its pickle declares. Streams the file; holds only the
    pickle in memory. See [Note: Safe DCP reading].

    Raises:
        UnsafeCheckpointError: (``ChecksumError`` for a CRC mismatch) naming the item and file.
    """
    info = md.storage_data[index]
    what = f"checkpoint item {describe(index.fqn)} (file {info.relative_path})"
    item = md.state_dict_metadata.get(index.fqn)
    chunk = None
    if isinstance(item, TensorStorageMetadata):
        chunk = next((c for c in item.chunks if c.offsets == index.offset), None)
    if chunk is None or not isinstance(item, TensorStorageMetadata):
        raise UnsafeCheckpointError(f"{what} has no tensor chunk at the offsets it is read from")
    nbytes = chunk_nbytes(item, chunk)
    with open(directory / info.relative_path, "rb") as f:
        if expected_crc is not None:
            got = _crc(f, info.offset, info.length)
            if got != expected_crc:
                raise ChecksumError(
                    f"{what} fails its checksum (crc32 {got:#010x}, saved {expected_crc:#010x}): "
                    f"the file was modified or corrupted after the save"
                )
        pkl, _ = open_blob(_FileSlice(f, info.offset, info.length), info.length, what)
    check_tensor_pickle(pkl, nbytes, what)


class _BytesGuard:
    """Forwards to a planner; checks and decodes a non-tensor item before it does."""

    def __init__(self, inner: LoadPlanner, reader: SafeFileSystemReader) -> None:
        self._inner = inner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        index = read_item.storage_index
        what = f"checkpoint item {describe(index.fqn)}"
        blob = value.getvalue()
        sums = self._reader.checksums
        if sums is not None:
            want = sums.get(storage_key(index.fqn, index.offset))
            got = zlib.crc32(blob)
            if want is None or got != want:
                raise ChecksumError(
                    f"{what} fails its checksum (crc32 {got:#010x}, saved "
                    f"{'none' if want is None else f'{want:#010x}'}): the file was modified or "
                    f"corrupted after the save"
                )
        if not self._reader.allow_pickle:
            decode_object(blob, what)  # see [Note: Safe DCP reading]
        self._inner.load_bytes(read_item, io.BytesIO(blob))


class SafeFileSystemReader(FileSystemReader):
    """A DCP ``FileSystemReader`` for checkpoints you do not trust: loading never runs their code.

    Pass it to ``torch.distributed.checkpoint.load(state_dict, storage_reader=...)``. It reads
    a checkpoint written by plain ``torch.distributed.checkpoint.save`` (or by
    :func:`shardkit.checkpoint.save`, whose committed version it finds through ``LATEST`` and
    whose CRC-32s it checks) and refuses a crafted one without running it:

    - ``.metadata`` goes through an allow-list unpickler (DCP's metadata classes, torch dtypes,
      layouts and ``torch.Size``, plain containers and scalars: anything else raises before any
      object is built), then every field is checked;
    - file names must stay inside the checkpoint directory, DCP storage transforms are refused,
      and every item must be backed by its bytes on disk before anything is read;
    - each stored tensor is checked (CRC-32 when known, zip structure, the sizes its pickle
      declares) before ``torch.load`` sees it; non-tensor items are decoded with
      ``torch.load(weights_only=True)`` after a bounded scan of their pickle.

    Reading costs time and memory linear in the checkpoint's metadata and records (see
    ``docs/security.md``). It does not compare the checkpoint with your state dict: DCP copies
    into the tensors you pass (and refuses other global shapes); :func:`shardkit.checkpoint.load`
    also checks dtypes and kinds first.

    Args:
        path: a DCP checkpoint directory, or a checkpoint written by
            :func:`shardkit.checkpoint.save` (its committed version is read; its commit record
            is required).
        allow_pickle: decode non-tensor items with DCP's default ``weights_only=False``
            unpickling (this RUNS CODE a crafted checkpoint contains; only for checkpoints you
            trust). The metadata is read through the allow-list either way.
        checksums: CRC-32 of each stored chunk by ``(item, chunk offsets)``; by default those of
            the commit record at ``path`` when there is one. Every chunk read must have one.
        allow_missing_commit_record: read a shardkit checkpoint whose commit record is missing
            or damaged, without CRC-32 checks (logged).

    Raises:
        CheckpointNotFoundError: ``path`` holds a shardkit checkpoint pointer naming no version.
        UnsafeCheckpointError: (from ``torch.distributed.checkpoint.load``, wrapped in its
            ``CheckpointException``) the checkpoint holds something outside these limits.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allow_pickle: bool = False,
        checksums: Mapping[StorageKey, int] | None = None,
        allow_missing_commit_record: bool = False,
    ) -> None:
        self.allow_pickle = allow_pickle
        self._given_checksums = checksums
        self._allow_missing = allow_missing_commit_record
        self.checksums: Mapping[StorageKey, int] | None = None
        self._metadata: Metadata | None = None
        self._refused: UnsafeCheckpointError | None = None
        super().__init__(self._locate(path))

    def _locate(self, path: str | os.PathLike[str]) -> Path:
        """The directory holding the DCP files (a committed version for a shardkit checkpoint),
        and the CRC-32s to check."""
        root = Path(path)
        self.checksums = self._given_checksums
        if (root / POINTER).is_file() or (root / MARKER).is_file():
            version = resolve(root, require_marker=not self._allow_missing)
            if self.checksums is None:
                try:
                    self.checksums = storage_checksums(read_commit_record(version))
                except UnsafeCheckpointError as e:
                    if not self._allow_missing:
                        raise
                    logger.warning("reading %s without its commit record: %s", root, e)
            return version
        return root

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(None if checkpoint_id is None else self._locate(checkpoint_id))
        self._metadata = None
        self._refused = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        if rank is not None and self._refused is not None and not (Path(self.path) / name).exists():
            raise self._refused  # DCP falls back to a rank's metadata: report why it did
        try:
            md = read_safe_metadata(self.path, name)
        except UnsafeCheckpointError as e:
            self._refused = e
            raise
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        validate_metadata(metadata, str(Path(self.path) / ".metadata"))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        check_storage(metadata, self.path)  # see [Note: Disk-backed sizes]
        if self.checksums is not None:
            check_checksum_keys(metadata, self.checksums, str(self.path))
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        md = self._metadata
        if md is None:
            raise RuntimeError("SafeFileSystemReader: set_up_storage_reader was not called")
        seen: set[StorageKey] = set()
        for item in plan.items:
            key = storage_key(item.storage_index.fqn, item.storage_index.offset)
            if item.type == LoadItemType.BYTE_IO or key in seen:
                continue  # non-tensor items are checked as they are read (_BytesGuard)
            seen.add(key)
            want = None if self.checksums is None else self.checksums.get(key)
            if self.checksums is not None and want is None:
                raise ChecksumError(f"checkpoint item {describe(key[0])} has no saved CRC-32")
            check_chunk(Path(self.path), md, item.storage_index, want)
        return super().prepare_local_plan(plan)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.allow_pickle and self.checksums is None:
            return super().read_data(plan, planner)
        return super().read_data(plan, _BytesGuard(planner, self))  # type: ignore[arg-type]
