"""``SafeFileSystemReader``: a DCP storage reader that reads a checkpoint as data.

What it checks, and when: [Note: Safe DCP reading] in ``_metadata.py``.
"""

from __future__ import annotations

import io
import logging
import os
import zlib
from collections.abc import Mapping
from typing import IO, Any

import torch

from shardkit.checkpoint._commit import (
    MARKER,
    POINTER,
    StorageKey,
    read_commit_record,
    resolve_location,
    storage_checksums,
    storage_key,
)
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import ChecksumError, UnsafeCheckpointError
from shardkit.checkpoint._fs import Location, as_location
from shardkit.checkpoint._metadata import check_storage, read_safe_metadata, validate_metadata
from shardkit.checkpoint._payload import decode_blob
from shardkit.checkpoint._scan import decode_object
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = [
    "SafeFileSystemReader",
    "check_checksum_keys",
    "check_chunk",
    "chunk_index",
    "read_span",
]

logger = logging.getLogger("shardkit.checkpoint")

ChunkIndex = dict[tuple[str, tuple[int, ...]], ChunkStorageMetadata]
"""Every stored tensor chunk of a checkpoint by ``(item, chunk offsets)``."""


class _FileSlice(io.RawIOBase):
    """``length`` bytes of an open file from ``offset``, seekable: what the zip reader reads a
    stored blob's headers through without holding the blob in memory."""

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


def _check_crc(what: str, got: int, want: int | None) -> None:
    if want is not None and got != want:
        raise ChecksumError(
            f"{what} fails its checksum (crc32 {got:#010x}, saved {want:#010x}): the file was "
            f"modified or corrupted after the save"
        )


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


def read_span(f: IO[bytes], offset: int, length: int, what: str) -> bytearray:
    """``length`` bytes of ``f`` from ``offset``, read into one buffer (tensors decoded from it
    share its memory).

    Raises:
        UnsafeCheckpointError: the file ends before (it shrank since its size was checked).
    """
    blob = bytearray(length)
    f.seek(offset)
    if f.readinto(blob) != length:  # type: ignore[attr-defined]
        raise UnsafeCheckpointError(f"{what} ends before its declared length: the file shrank")
    return blob


def chunk_index(md: Metadata) -> ChunkIndex:
    """Every stored tensor chunk of validated metadata by ``(item, offsets)``: one lookup per
    chunk read instead of a scan of its item's chunks (quadratic in their number)."""
    out: ChunkIndex = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            for c in item.chunks:
                out[(fqn, tuple(c.offsets))] = c
    return out


def _chunk_of(
    md: Metadata, chunks: ChunkIndex, index: MetadataIndex, what: str
) -> tuple[TensorStorageMetadata, ChunkStorageMetadata]:
    item = md.state_dict_metadata.get(index.fqn)
    chunk = None if index.offset is None else chunks.get((index.fqn, tuple(index.offset)))
    if chunk is None or not isinstance(item, TensorStorageMetadata):
        raise UnsafeCheckpointError(f"{what} has no tensor chunk at the offsets it is read from")
    return item, chunk


def _check_decoded(what: str, t: Any, item: TensorStorageMetadata, chunk: Any) -> None:
    """A decoded chunk is a tensor of the chunk's sizes and the item's dtype (DCP would cast
    another dtype silently)."""
    if (
        not isinstance(t, torch.Tensor)
        or tuple(t.shape) != tuple(chunk.sizes)
        or t.dtype != item.properties.dtype
    ):
        raise UnsafeCheckpointError(
            f"{what} holds {describe(t)} where the metadata declares a chunk of sizes "
            f"{tuple(chunk.sizes)} and dtype {item.properties.dtype}; the checkpoint is damaged "
            f"or crafted"
        )


def check_chunk(
    directory: Location | str | os.PathLike[str],
    md: Metadata,
    index: MetadataIndex,
    expected_crc: int | None,
    chunks: ChunkIndex | None = None,
    f: IO[bytes] | None = None,
) -> None:
    """Checks one stored tensor chunk before it is decoded into a destination: its CRC-32
    (when known), its zip records and its pickle (decoded on the meta device: no payload is
    allocated). Streams the file. See [Note: Safe DCP reading].

    Args:
        directory: the directory of the checkpoint's files.
        md: its validated metadata.
        index: the chunk.
        expected_crc: its saved CRC-32, or None.
        chunks: :func:`chunk_index` of ``md`` (built here when not given).
        f: the item's file, already opened from ``directory`` (opened here when not given).

    Raises:
        UnsafeCheckpointError: (``ChecksumError`` for a CRC mismatch) naming the item and file.
    """
    info = md.storage_data[index]
    what = f"checkpoint item {describe(index.fqn)} (file {info.relative_path})"
    item, chunk = _chunk_of(md, chunk_index(md) if chunks is None else chunks, index, what)
    if f is None:
        with as_location(directory).open(info.relative_path) as opened:
            t = _check_blob(opened, info.offset, info.length, expected_crc, what)
    else:
        t = _check_blob(f, info.offset, info.length, expected_crc, what)
    _check_decoded(what, t, item, chunk)


_IN_MEMORY = 1 << 22


def _check_blob(f: IO[bytes], offset: int, length: int, crc: int | None, what: str) -> Any:
    """CRC-32 and meta decode of one stored tensor blob: read whole when small, else streamed
    (the CRC over the file, the zip's headers and pickle read where they lie)."""
    if length <= _IN_MEMORY:
        f.seek(offset)
        blob = f.read(length)
        if len(blob) != length:
            raise UnsafeCheckpointError(f"{what} ends before its declared length")
        _check_crc(what, zlib.crc32(blob), crc)
        return decode_blob(io.BytesIO(blob), length, what, tensor=True, meta=True)
    _check_crc(what, _crc(f, offset, length), crc)
    view = _FileSlice(f, offset, length)
    return decode_blob(view, length, what, tensor=True, meta=True)  # type: ignore[arg-type]


# [Note: A refused metadata stays typed]
# DCP's load reads ``.metadata`` inside ``except Exception``, then falls back to a rank's own
# ``__<rank>.metadata`` and, when both failed, raises ``AssertionError("metadata is None; ...")``
# with the reader's refusal as text only. So after a refusal, when DCP asks for a rank's file
# that does not exist, the reader answers with an empty placeholder ``Metadata`` (never used:
# DCP's next call on the reader is ``set_up_storage_reader``), and ``set_up_storage_reader``
# raises the refusal itself, outside DCP's ``except``: the ``CheckpointException`` then holds
# the ``UnsafeCheckpointError`` as the failure of every rank, which
# :func:`shardkit.checkpoint.checkpoint_error` returns. A direct ``read_metadata()`` call
# raises the refusal as it always did.
class SafeFileSystemReader(FileSystemReader):
    """A DCP ``FileSystemReader`` for checkpoints you do not trust: loading never runs their code.

    Pass it to ``torch.distributed.checkpoint.load(state_dict, storage_reader=...)``. It reads
    a checkpoint written by plain ``torch.distributed.checkpoint.save`` (or by
    :func:`shardkit.checkpoint.save`, whose committed version it finds through ``LATEST`` and
    whose CRC-32s it checks) and refuses a crafted one without running it:

    - ``.metadata`` goes through an allow-list unpickler (DCP's metadata classes, torch dtypes,
      layouts and ``torch.Size``, plain containers and scalars: anything else raises before any
      object is built), then every field is checked;
    - file names must stay inside the checkpoint directory, no file or directory below the
      path you pass may be a link (checked as each file is opened), DCP storage transforms are
      refused, the chunks of every tensor must tile it exactly, and every item must be backed
      by its bytes on disk before anything is read;
    - every stored item (tensor chunk or value) is read once, checked against its CRC-32 when
      known, and decoded by shardkit's own allow-list decoder (never ``torch.load``): one plain
      zip, a pickle of plain data and tensors with bounded work; every item this rank reads is
      checked before anything is copied into your state dict.

    Under ``dcp.load`` a refusal reaches you inside DCP's ``CheckpointException``:
    :func:`shardkit.checkpoint.checkpoint_error` returns the typed error.

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
        self._refused_md: Metadata | None = None
        self.location: Location = self._locate(path)
        self._chunks: ChunkIndex = {}
        super().__init__(self.location.path)

    def _locate(self, path: str | os.PathLike[str]) -> Location:
        """The directory holding the DCP files (a committed version for a shardkit checkpoint),
        and the CRC-32s to check. See [Note: No path leaves the checkpoint]."""
        self.checksums = self._given_checksums
        if isinstance(path, Location) and path.sub:
            return path  # a version already resolved (Checkpoint.reader)
        root = as_location(path)
        if root.is_file(POINTER) or root.is_file(MARKER):
            version = resolve_location(root, require_marker=not self._allow_missing)
            if self.checksums is None:
                try:
                    self.checksums = storage_checksums(read_commit_record(version))
                except UnsafeCheckpointError as e:
                    if not self._allow_missing:
                        raise
                    logger.warning("reading %s without its commit record: %s", root.path, e)
            return version
        return root

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.location = self._locate(checkpoint_id)
        super().reset(None if checkpoint_id is None else self.location.path)
        self._metadata = None
        self._refused = None
        self._refused_md = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        if rank is not None and self._refused is not None and self.location.size(name) < 0:
            # DCP falls back to a rank's metadata: see [Note: A refused metadata stays typed]
            self._refused_md = Metadata(state_dict_metadata={})
            return self._refused_md
        try:
            md = read_safe_metadata(self.location, name)
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
        if self._refused is not None and metadata is self._refused_md:
            raise self._refused
        validate_metadata(metadata, str(self.location.path / ".metadata"))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        check_storage(metadata, self.location)  # see [Note: Disk-backed sizes]
        if self.checksums is not None:
            check_checksum_keys(metadata, self.checksums, str(self.location.path))
        self._metadata = metadata
        self._chunks = chunk_index(metadata)

    def _want(self, index: MetadataIndex) -> int | None:
        if self.checksums is None:
            return None
        want = self.checksums.get(storage_key(index.fqn, index.offset))
        if want is None:
            raise ChecksumError(f"checkpoint item {describe(index.fqn)} has no saved CRC-32")
        return want

    def _md(self) -> Metadata:
        if self._metadata is None:
            raise RuntimeError("SafeFileSystemReader: set_up_storage_reader was not called")
        return self._metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Checks every stored item this rank will read before anything is copied into the
        destination (a refusal leaves it untouched); see [Note: Safe DCP reading]."""
        md = self._md()
        seen: set[StorageKey] = set()
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            index = item.storage_index
            key = storage_key(index.fqn, index.offset)
            if key not in seen:
                seen.add(key)
                per_file.setdefault(md.storage_data[index].relative_path, []).append(item)
        for rel, items in per_file.items():
            with self.location.open(rel) as f:
                for item in sorted(items, key=lambda r: md.storage_data[r.storage_index].offset):
                    index = item.storage_index
                    if item.type == LoadItemType.BYTE_IO:
                        self._object(f, index)
                    else:
                        check_chunk(self.location, md, index, self._want(index), self._chunks, f)
        return super().prepare_local_plan(plan)

    def _blob(self, f: IO[bytes], index: MetadataIndex, what: str) -> bytearray:
        """The stored bytes of one item, read once and checked against their CRC-32: the bytes
        that are then decoded (see [Note: One decoder for stored items])."""
        info = self._md().storage_data[index]
        blob = read_span(f, info.offset, info.length, what)
        _check_crc(what, zlib.crc32(blob), self._want(index))
        return blob

    def _what(self, index: MetadataIndex) -> str:
        info = self._md().storage_data[index]
        return f"checkpoint item {describe(index.fqn)} (file {info.relative_path})"

    def _object(self, f: IO[bytes], index: MetadataIndex) -> bytearray:
        """A non-tensor item's stored bytes, checked (decoded too unless ``allow_pickle``)."""
        what = self._what(index)
        blob = self._blob(f, index, what)
        if not self.allow_pickle:
            decode_object(blob, what)
        return blob

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads, checks and decodes every item of ``plan`` (never with ``torch.load``: see
        [Note: One decoder for stored items]) and hands it to ``planner`` as DCP's reader does.
        """
        if self.allow_pickle and self.checksums is None:
            return super().read_data(plan, planner)  # trusted and unverifiable: DCP's own path
        md = self._md()
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(md.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            with self.location.open(rel) as f:
                for req in sorted(reqs, key=lambda r: md.storage_data[r.storage_index].offset):
                    self._read_item(f, req, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, f: IO[bytes], req: ReadItem, planner: LoadPlanner) -> None:
        index = req.storage_index
        what = self._what(index)
        blob = self._blob(f, index, what)
        if req.type == LoadItemType.BYTE_IO:
            if self.allow_pickle:
                planner.load_bytes(req, io.BytesIO(blob))
                return
            value = decode_object(blob, what)
            canonical = io.BytesIO()
            torch.save(value, canonical)  # plain data, written here: see the Note
            canonical.seek(0)
            planner.load_bytes(req, canonical)
            return
        item, chunk = _chunk_of(self._md(), self._chunks, index, what)
        tensor = decode_blob(blob, len(blob), what, tensor=True)
        _check_decoded(what, tensor, item, chunk)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise UnsafeCheckpointError(
                f"{what}: the destination of a read has sizes {tuple(target.size())}, the stored "
                f"part {tuple(tensor.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)
