"""DCP metadata read as data: the allow-list, a field-by-field check, and the storage check.

[Note: Disk-backed sizes]
Every buffer a load allocates for a stored item must be backed by distinct bytes on disk, so a
``.metadata`` that declares a terabyte tensor is refused before anything is allocated, not
allocated: :func:`check_storage` requires, for every item of the metadata, that each stored
chunk holds at least its declared bytes (numel times itemsize) and at most that plus
``torch.save``'s framing (:data:`FRAMING`), that the chunks of a tensor tile it exactly (see
[Note: Exact tiling]), that every span lies inside its file, and that no two spans share a byte
of a file.
The memory a load allocates is then bounded by the bytes of the checkpoint's files, plus the
tensors of the destination state dict the caller owns (see [Note: Load checks]).
"""

from __future__ import annotations

import os
import re
import struct
from typing import Any

import torch
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import UnsafeCheckpointError
from shardkit.checkpoint._fs import LinkedPathError, Location, as_location
from shardkit.checkpoint._torch_compat import STORAGE_INFO
from shardkit.checkpoint._unpickle import UnsafePickleError, restricted_loads
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

__all__ = [
    "FRAMING",
    "check_storage",
    "check_tiling",
    "chunk_nbytes",
    "numel",
    "read_safe_metadata",
    "validate_metadata",
]

FRAMING = 64 * 1024
"""``torch.save``'s zip framing around a tensor's bytes (records, headers, 64-byte alignment) is
about 1.5 KiB; a stored tensor may take at most this many bytes beyond its data."""

_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
_HUGE = 1 << 63


def numel(shape: Any) -> int:
    """The product of ``shape``'s dims, capped just above 2**63 (a crafted shape of many huge
    dims must not cost a product of thousands of digits)."""
    dims = list(shape)
    if 0 in dims:
        return 0
    n = 1
    for d in dims:
        n *= int(d)
        if n > _HUGE:
            return _HUGE + 1
    return n


def chunk_nbytes(item: TensorStorageMetadata, chunk: ChunkStorageMetadata) -> int:
    """The bytes a stored chunk of a tensor item holds once loaded."""
    return numel(chunk.sizes) * item.properties.dtype.itemsize


def _fail(what: str, message: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{what}: {message}; the checkpoint is damaged or crafted")


def _is_size(v: Any, ndim: int | None = None) -> bool:
    return (
        type(v) is torch.Size
        and (ndim is None or len(v) == ndim)
        and all(type(d) is int and d >= 0 for d in v)
    )


def _is_path(v: Any) -> bool:
    return v is None or type(v) is str or isinstance(v, os.PathLike)


def _check_storage_entry(what: str, key: Any, info: Any) -> None:
    if type(key) is not MetadataIndex or type(getattr(key, "fqn", None)) is not str:
        raise _fail(what, f"storage_data key {describe(key)} is not a MetadataIndex")
    if not (key.offset is None or _is_size(key.offset)):
        raise _fail(what, f"storage_data[{describe(key.fqn)}] has offsets {describe(key.offset)}")
    if STORAGE_INFO is None or type(info) is not STORAGE_INFO:
        raise _fail(what, f"storage_data[{describe(key.fqn)}] is not a storage entry")
    state = info.__dict__
    rel, off, length = (state.get(n) for n in ("relative_path", "offset", "length"))
    if type(rel) is not str or not _FILE_NAME.match(rel) or rel in (".", ".."):
        raise _fail(
            what,
            f"item {describe(key.fqn)} names file {describe(rel)}, not a file of the checkpoint",
        )
    if type(off) is not int or type(length) is not int or off < 0 or length < 0:
        raise _fail(
            what, f"item {describe(key.fqn)} has offset {describe(off)} / length {describe(length)}"
        )
    transforms = state.get("transform_descriptors")
    if transforms:
        raise _fail(
            what,
            f"item {describe(key.fqn)} uses storage transforms {describe(transforms)} (DCP "
            f"extensions), which a safe load does not run",
        )


def _check_tensor_item(what: str, fqn: str, item: Any, storage: dict[Any, Any]) -> None:
    state = item.__dict__
    props, size, chunks = (state.get(n) for n in ("properties", "size", "chunks"))
    if type(props) is not TensorProperties or not isinstance(
        props.__dict__.get("dtype"), torch.dtype
    ):
        raise _fail(what, f"item {describe(fqn)} has no valid dtype")
    if not _is_size(size) or type(chunks) is not list:
        raise _fail(
            what, f"item {describe(fqn)} has size {describe(size)} / chunks {describe(chunks)}"
        )
    for c in chunks:
        ok = type(c) is ChunkStorageMetadata
        ok = ok and _is_size(c.__dict__.get("offsets"), len(size))
        ok = ok and _is_size(c.__dict__.get("sizes"), len(size))
        if not ok or any(o + s > d for o, s, d in zip(c.offsets, c.sizes, size, strict=True)):
            raise _fail(
                what, f"item {describe(fqn)} has a chunk {describe(c)} outside its size {size}"
            )
        if MetadataIndex(fqn, c.offsets) not in storage:
            raise _fail(what, f"item {describe(fqn)} has a chunk with no storage entry")


def _check_planner_data(what: str, data: Any) -> None:
    """DCP's default planner writes ``{fqn: key path}`` (a tuple of strs and ints) or None."""
    if data is None:
        return
    if type(data) is not dict:
        raise _fail(what, f"planner_data is {describe(data)}, not DCP's {{fqn: key path}}")
    for fqn, path in data.items():
        if type(path) not in (tuple, list) or not all(type(p) in (str, int) for p in path):
            raise _fail(what, f"planner_data[{describe(fqn)}] is {describe(path)}, not a key path")


def _check_storage_meta(what: str, meta: Any) -> None:
    if meta is None:
        return
    if type(meta) is not StorageMeta:
        raise _fail(what, f"storage_meta is {describe(meta)}, not a StorageMeta")
    state = meta.__dict__
    ok = _is_path(state.get("checkpoint_id"))
    ok = ok and all(type(state.get(n)) in (str, type(None)) for n in ("save_id", "load_id"))
    modules = state.get("modules", [])
    ok = ok and type(modules) is list and all(type(m) is str for m in modules)
    if not ok:
        raise _fail(what, f"storage_meta {describe(meta)} has fields of the wrong type")


def validate_metadata(md: Any, what: str) -> Metadata:
    """Checks the structure of unpickled DCP metadata. See [Note: Safe DCP reading].

    Reads every field through the object's ``__dict__`` and checks its exact type before using
    it; describes what it refuses with :func:`describe` (see [Note: Bounded work on untrusted
    input]).

    Raises:
        UnsafeCheckpointError: naming the first field that is not what DCP writes.
    """
    if type(md) is not Metadata:
        raise _fail(what, f"holds {describe(md)}, not DCP Metadata")
    state = md.__dict__
    items = state.get("state_dict_metadata")
    if type(items) is not dict:
        raise _fail(what, "state_dict_metadata is not a dict")
    storage = state.get("storage_data")
    if type(storage) is not dict:
        raise _fail(what, "storage_data is not a dict")
    for key, info in storage.items():
        _check_storage_entry(what, key, info)
    for fqn, item in items.items():
        if type(fqn) is not str:
            raise _fail(what, f"item name {describe(fqn)} is not a str")
        if type(item) is BytesStorageMetadata:
            if MetadataIndex(fqn) not in storage:
                raise _fail(what, f"item {describe(fqn)} has no storage entry")
        elif type(item) is TensorStorageMetadata:
            _check_tensor_item(what, fqn, item, storage)
        else:
            raise _fail(what, f"item {describe(fqn)} is {describe(item)}")
    _check_planner_data(what, state.get("planner_data"))
    _check_storage_meta(what, state.get("storage_meta"))
    if type(state.get("version")) not in (str, type(None)):
        raise _fail(what, f"version is {describe(state.get('version'))}")
    return md


# [Note: Safe DCP reading]
# What torch's ``FileSystemReader`` trusts, and what ``SafeFileSystemReader`` checks instead:
#
# - ``.metadata`` is unpickled through the allow-list (see [Note: Allow-list unpickling]) and
#   then validated field by field (:func:`validate_metadata`): every item's storage entry
#   exists, names a plain file of the checkpoint directory (no ``/``, no ``..``: a crafted path
#   cannot make a load read ``/etc/shadow``), uses no storage transform (a DCP extension such
#   as a decompressor could inflate a small file), and every chunk lies inside its tensor;
#   the planner data is DCP's default ``{fqn: key path}``.
# - Before any payload is read, every item is backed by bytes of its files (see [Note:
#   Disk-backed sizes]).
# - Every file is opened below the directory the user named without following a link (see
#   [Note: No path leaves the checkpoint]), and the chunks of each tensor tile it exactly (see
#   [Note: Exact tiling]).
# - No stored byte reaches ``torch.load`` (see [Note: One decoder for stored items]). Before
#   anything is copied into the destination, every item this rank reads is checked: its CRC-32
#   when the checkpoint has one (a shardkit commit record), then its ``torch.save`` zip and its
#   pickle decoded by shardkit's allow-list (tensors on the meta device: nothing allocated).
#   Then each item is read once more, checked against its CRC-32 again and decoded from those
#   very bytes: a tensor chunk as a view of them (of the declared dtype and sizes), copied into
#   the destination; a non-tensor value measured (``_scan.py``) and handed to DCP's planner as a
#   ``torch.save`` shardkit writes from the decoded plain data. ``allow_pickle=True`` hands the
#   stored bytes of non-tensor values to the planner as they are (for trusted checkpoints).
#
# None of this compares the checkpoint with the destination: the caller's state dict does (DCP
# copies into the tensors it holds; ``shardkit.checkpoint.load`` checks every entry against it
# first, see [Note: Load checks]).
def read_safe_metadata(
    directory: Location | str | os.PathLike[str], name: str = ".metadata"
) -> Metadata:
    """DCP metadata of ``directory``, read through the allow-list and validated.

    Raises:
        UnsafeCheckpointError: the file is missing, a link (see [Note: No path leaves the
            checkpoint]), not a regular file, or not DCP metadata.
    """
    where = as_location(directory)
    path = where.path / name
    try:
        data = where.read(name)
    except LinkedPathError:
        raise
    except (FileNotFoundError, NotADirectoryError, UnsafeCheckpointError):
        raise UnsafeCheckpointError(
            f"{path} is missing or not a regular file; the checkpoint is damaged (or the "
            f"directory is not a torch.distributed.checkpoint checkpoint)"
        ) from None
    try:
        md = restricted_loads(data, str(path))
    except UnsafePickleError as e:
        raise UnsafeCheckpointError(f"{e}; the checkpoint is damaged or crafted") from None
    return validate_metadata(md, str(path))


# [Note: Exact tiling]
# The chunks of a tensor must cover each of its elements exactly once: a gap leaves elements at
# whatever the destination held, an overlap lets one chunk's bytes silently override another's,
# and "the chunks hold as many elements as the tensor" accepts both at once ([0, 8) and
# [4, 12) of 16). Each chunk lies inside the tensor (``_check_tensor_item``); then the sum of
# the chunks' indicator functions equals the tensor's iff their mixed finite differences are
# equal (the difference operator is invertible on functions of bounded support), and the mixed
# difference of a box's indicator is +-1 at its 2**d corners and 0 elsewhere. So the signed
# corners of all chunks, added up, must be exactly the tensor's own: linear in the number of
# chunks (times 2**d, d the number of dimensions along which some chunk does not span the whole
# tensor), in any number of dimensions. Corners are keyed by their bytes (randomised hashes: a
# crafted set of corners cannot flood the dict).
def check_tiling(size: Any, chunks: list[tuple[Any, Any]], what: str) -> None:
    """The boxes ``(offsets, sizes)`` inside ``size`` tile it exactly. See [Note: Exact tiling].

    Raises:
        UnsafeCheckpointError: a gap or an overlap, or more split dimensions than the work
            bound admits.
    """
    dims = [d for d in range(len(size)) if any(o[d] != 0 or s[d] != size[d] for o, s in chunks)]
    if any(size[d] == 0 for d in range(len(size))):
        return  # an empty tensor: every chunk inside it is empty too
    if len(chunks) << len(dims) > max(1 << 22, 64 * len(chunks)):
        raise _fail(
            what,
            f"its {len(chunks)} chunks split it along {len(dims)} dimensions, beyond the work "
            f"bound of an exact tiling check",
        )
    pack = struct.Struct(f"<{len(dims)}q").pack
    total: dict[bytes, int] = {}
    for offsets, sizes in chunks:
        if any(sizes[d] == 0 for d in range(len(size))):
            continue  # an empty chunk covers nothing
        for mask in range(1 << len(dims)):
            corner = [offsets[d] + (sizes[d] if mask >> i & 1 else 0) for i, d in enumerate(dims)]
            key = pack(*corner)
            total[key] = total.get(key, 0) + (-1 if bin(mask).count("1") & 1 else 1)
    for mask in range(1 << len(dims)):
        corner = [size[d] if mask >> i & 1 else 0 for i, d in enumerate(dims)]
        key = pack(*corner)
        total[key] = total.get(key, 0) - (-1 if bin(mask).count("1") & 1 else 1)
    if any(total.values()):
        raise _fail(
            what,
            f"its {len(chunks)} chunks do not tile it exactly (they overlap or leave a gap)",
        )


def check_storage(metadata: Metadata, directory: Location | str | os.PathLike[str]) -> None:
    """Every item of validated ``metadata`` is backed by distinct bytes of the files in
    ``directory``. See [Note: Disk-backed sizes].

    Raises:
        UnsafeCheckpointError: naming the first item whose sizes do not fit, or the file that
            is absent or too short.
    """
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for c in md.chunks:
                info = metadata.storage_data[MetadataIndex(key, c.offsets)]
                nbytes = chunk_nbytes(md, c)
                if not nbytes <= info.length <= nbytes + FRAMING:
                    raise _fail(
                        f"checkpoint item {describe(key)}",
                        f"a chunk declares {nbytes} bytes stored in {info.length}: the sizes "
                        f"do not match",
                    )
                spans.setdefault(info.relative_path, []).append((info.offset, info.length, key))
            check_tiling(
                md.size,
                [(c.offsets, c.sizes) for c in md.chunks],
                f"checkpoint item {describe(key)}",
            )
        else:
            info = metadata.storage_data[MetadataIndex(key)]
            spans.setdefault(info.relative_path, []).append((info.offset, info.length, key))
    where = as_location(directory)
    for rel, items in sorted(spans.items()):
        f = where.path / rel
        size = where.size(rel)
        end = 0
        for offset, length, key in sorted(items):
            if offset < end:
                raise _fail(f"checkpoint item {describe(key)}", f"it shares bytes of {rel}")
            end = offset + length
        if end > size:
            raise UnsafeCheckpointError(
                f"{f} {'is absent or not a regular file' if size < 0 else f'has {size} bytes'} "
                f"but the metadata needs {end}: the checkpoint is truncated or damaged"
            )
