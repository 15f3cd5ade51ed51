"""``SafeFileSystemReader``: a DCP storage reader that reads a checkpoint as data.

[Note: Safe DCP reading]
What torch's ``FileSystemReader`` trusts, and what this reader checks instead:

- ``.metadata`` is unpickled through the allow-list (see [Note: Allow-list unpickling]) and
  then validated field by field (``validate_metadata``): every item's storage entry exists,
  names a plain file of the checkpoint directory (no ``/``, no ``..``: a crafted path cannot
  make a load read ``/etc/shadow``), uses no storage transform (a DCP extension such as a
  decompressor could inflate a small file), and every chunk lies inside its tensor.
- Before any payload is read (``set_up_storage_reader``), every file the metadata names must
  exist with at least ``offset + length`` bytes.
- Before a tensor's bytes reach ``torch.load`` (``prepare_local_plan``), its slice is checked
  to be no longer than its declared tensor's bytes plus a fixed allowance for ``torch.save``'s
  framing, and to be a zip of uncompressed records none larger than the slice whose pickle
  (read with ``pickletools``, nothing built) names no integer larger than the tensor's bytes:
  ``torch.load`` allocates what that pickle declares before it reads, so a crafted record
  could otherwise ask for terabytes. DCP itself then loads each tensor with
  ``weights_only=True``.
- A non-tensor item (DCP writes Python objects as ``torch.save`` blobs and reads them back with
  ``weights_only=False``) is first decoded with ``weights_only=True`` on the very bytes DCP will
  decode; anything outside torch's weights-only allow-list raises. ``allow_pickle=True`` turns
  this one check off (for trusted checkpoints of shardkit-optim's format 1).

None of this compares the checkpoint with the model: the caller's state dict does (DCP copies
into the tensors it holds; ``shardkit.optim.load_sharded`` checks every size against the model
first, see [Note: Load validation]).
"""

from __future__ import annotations

import io
import os
import pickletools
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from shardkit.optim._unpickle import _DATACLASSES, UnsafePickleError, restricted_loads
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = ["SafeFileSystemReader", "UnsafeCheckpointError"]

# torch.save's zip framing around a tensor's bytes (records, headers, 64-byte alignment) is
# about 1.5 KiB; anything beyond this allowance is not a tensor of the declared size.
_FRAMING = 64 * 1024
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
_STORAGE_INFO: type | None = _DATACLASSES.get(
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
)


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something a safe load refuses (code, a malformed record, sizes that
    do not fit its files or the model): it was damaged or crafted."""


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def item_nbytes(md: TensorStorageMetadata) -> int:
    """The bytes a tensor item of the metadata occupies once loaded."""
    return _numel(md.size) * md.properties.dtype.itemsize


def _fail(what: str, message: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{what}: {message}; the checkpoint is damaged or crafted")


def _is_size(v: Any, ndim: int | None = None) -> bool:
    return (
        isinstance(v, torch.Size)
        and (ndim is None or len(v) == ndim)
        and all(type(d) is int and d >= 0 for d in v)
    )


def validate_metadata(md: Any, what: str) -> Metadata:
    """Checks the structure of unpickled DCP metadata. See [Note: Safe DCP reading].

    Raises:
        UnsafeCheckpointError: naming the first field that is not what DCP writes.
    """
    if not isinstance(md, Metadata):
        raise _fail(what, f"holds a {type(md).__name__}, not DCP Metadata")
    items = getattr(md, "state_dict_metadata", None)
    if not isinstance(items, dict):
        raise _fail(what, "state_dict_metadata is not a dict")
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise _fail(what, "storage_data is not a dict")
    for key, info in storage.items():
        if not isinstance(key, MetadataIndex) or type(getattr(key, "fqn", None)) is not str:
            raise _fail(what, f"storage_data key {key!r:.100} is not a MetadataIndex")
        if _STORAGE_INFO is None or type(info) is not _STORAGE_INFO:
            raise _fail(what, f"storage_data[{key.fqn!r}] is not a storage entry")
        rel, off, length = (getattr(info, n, None) for n in ("relative_path", "offset", "length"))
        if type(rel) is not str or not _FILE_NAME.match(rel) or rel in (".", ".."):
            raise _fail(
                what, f"item {key.fqn!r} names file {rel!r:.100}, not a file of the checkpoint"
            )
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            raise _fail(what, f"item {key.fqn!r} has offset {off!r:.40} / length {length!r:.40}")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:
            raise _fail(
                what,
                f"item {key.fqn!r} uses storage transforms {transforms!r:.100} "
                f"(DCP extensions), which a safe load does not run",
            )
    for fqn, item in items.items():
        if type(fqn) is not str:
            raise _fail(what, f"item name {fqn!r:.100} is not a str")
        if isinstance(item, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise _fail(what, f"item {fqn!r} has no storage entry")
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise _fail(what, f"item {fqn!r} is a {type(item).__name__}")
        props, size, chunks = (getattr(item, n, None) for n in ("properties", "size", "chunks"))
        if not isinstance(props, TensorProperties) or not isinstance(
            getattr(props, "dtype", None), torch.dtype
        ):
            raise _fail(what, f"item {fqn!r} has no valid dtype")
        if not isinstance(size, torch.Size) or not _is_size(size) or not isinstance(chunks, list):
            raise _fail(what, f"item {fqn!r} has size {size!r:.100} / chunks {chunks!r:.100}")
        for c in chunks:
            ok = isinstance(c, ChunkStorageMetadata) and _is_size(
                getattr(c, "offsets", None), len(size)
            )
            ok = ok and _is_size(getattr(c, "sizes", None), len(size))
            if not ok or any(o + s > d for o, s, d in zip(c.offsets, c.sizes, size, strict=True)):
                raise _fail(what, f"item {fqn!r} has a chunk {c!r:.100} outside its size {size}")
            if MetadataIndex(fqn, c.offsets) not in storage:
                raise _fail(what, f"item {fqn!r} has a chunk with no storage entry")
    if not isinstance(getattr(md, "storage_meta", None), (StorageMeta, type(None))):
        raise _fail(what, "storage_meta is not a StorageMeta")
    return md


def read_safe_metadata(directory: str | os.PathLike[str], name: str = ".metadata") -> Metadata:
    """DCP metadata of ``directory``, read through the allow-list and validated."""
    path = Path(directory) / name
    if not path.is_file():  # a FIFO or device would block or never end
        raise FileNotFoundError(f"{path} is not a regular file; the checkpoint is damaged")
    data = path.read_bytes()
    try:
        md = restricted_loads(data, str(path))
    except UnsafePickleError as e:
        raise UnsafeCheckpointError(f"{e}; the checkpoint is damaged or crafted") from None
    return validate_metadata(md, str(path))


def _chunk_bytes(md: Metadata, index: MetadataIndex) -> int | None:
    item = md.state_dict_metadata.get(index.fqn)
    if not isinstance(item, TensorStorageMetadata):
        return None
    for c in item.chunks:
        if c.offsets == index.offset:
            return _numel(c.sizes) * item.properties.dtype.itemsize
    return None


def check_tensor_blob(blob: bytes, nbytes: int, what: str) -> None:
    """A ``torch.save`` blob of one tensor of ``nbytes`` bytes allocates no more than that.

    See [Note: Safe DCP reading]. Nothing is built: zip headers and pickle opcodes are read.
    """
    if len(blob) > nbytes + _FRAMING:
        raise _fail(what, f"its data has {len(blob)} bytes for a tensor of {nbytes} bytes")
    bound = max(nbytes, 1 << 16)
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            pkl = None
            for info in z.infolist():
                if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(blob):
                    raise _fail(
                        what, f"its record {info.filename!r:.80} is compressed or oversized"
                    )
                if info.filename.endswith("/data.pkl"):
                    pkl = z.read(info)
            if pkl is None:
                raise _fail(what, "it holds no tensor record")
        for op, arg, _ in pickletools.genops(pkl):
            if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > bound:
                raise _fail(what, f"its record declares {arg} (op {op.name}) for {nbytes} bytes")
    except UnsafeCheckpointError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise _fail(what, f"its data is not a tensor record ({type(e).__name__}: {e})") from None


class _BytesGuard:
    """Forwards to a planner; decodes a non-tensor item with ``weights_only=True`` first."""

    def __init__(self, inner: LoadPlanner) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            raise UnsafeCheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r} holds a pickled object outside "
                f"torch's weights-only allow-list ({type(e).__name__}: {str(e)[:200]}); it is "
                f"refused (pass allow_pickle=True only for a checkpoint you trust)"
            ) from None
        value.seek(0)
        self._inner.load_bytes(read_item, value)


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` for checkpoints you do not trust: loading never runs their code.

    Pass it to ``torch.distributed.checkpoint.load(state_dict, storage_reader=...)``; every
    shardkit load path uses it. It reads ``.metadata`` through an allow-list unpickler (DCP's
    metadata classes, torch dtypes, layouts and ``torch.Size``, plain containers and scalars:
    anything else raises before any object is built), validates every field, refuses file
    names outside the checkpoint directory and DCP storage transforms, bounds every tensor's
    stored bytes by its declared size before ``torch.load`` sees them, and decodes non-tensor
    items with ``torch.load(weights_only=True)``. See ``docs/security.md``.

    Args:
        path: the checkpoint directory (DCP's ``checkpoint_id``).
        allow_pickle: decode non-tensor items with DCP's default ``weights_only=False`` unpickling
            (this RUNS CODE a crafted checkpoint contains; only for checkpoints you trust).
            The metadata is read through the allow-list either way.

    Raises:
        UnsafeCheckpointError: (from ``torch.distributed.checkpoint.load``, possibly wrapped in
            its ``CheckpointException``) the checkpoint holds something outside these limits.
    """

    def __init__(self, path: str | os.PathLike[str], *, allow_pickle: bool = False) -> None:
        super().__init__(path)
        self.allow_pickle = allow_pickle
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = read_safe_metadata(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        validate_metadata(metadata, str(Path(self.path) / ".metadata"))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(
                needed.get(info.relative_path, 0), info.offset + info.length
            )
        for rel, size in sorted(needed.items()):
            f = Path(self.path) / rel
            have = f.stat().st_size if f.is_file() else -1
            if have < size:
                raise _fail(
                    str(f),
                    f"the metadata needs {size} bytes of it, the file "
                    f"{'is absent' if have < 0 else f'has {have}'}",
                )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        md = self._metadata
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO or md is None:
                continue
            nbytes = _chunk_bytes(md, item.storage_index)
            info = self.storage_data[item.storage_index]
            what = f"checkpoint item {item.storage_index.fqn!r} (file {info.relative_path})"
            if nbytes is None:
                raise _fail(what, "it has no tensor chunk at the offsets it is read from")
            if info.length > nbytes + _FRAMING:
                raise _fail(what, f"its data has {info.length} bytes for {nbytes} bytes")
            with open(Path(self.path) / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            check_tensor_blob(blob, nbytes, what)
        return super().prepare_local_plan(plan)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.allow_pickle:
            return super().read_data(plan, planner)
        return super().read_data(plan, _BytesGuard(planner))  # type: ignore[arg-type]
