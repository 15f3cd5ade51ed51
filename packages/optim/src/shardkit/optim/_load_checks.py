"""What an optimizer load checks before it reads a payload or allocates a buffer.

[Note: Load validation]
Every rank checks the whole checkpoint against its params before anything is read or any
state is touched, on information all ranks share (the commit record and DCP's metadata, read
safely by ``shardkit.checkpoint.open_checkpoint``: see [Note: Safe DCP reading]), so a mismatch
raises the same error on every rank instead of only on the owner of the mismatching entry
(whose peers would then wait in the next collective):

- the number of params and every param's shape exactly (including size-1 dims), from the
  commit record;
- every item is one the format writes (``state/i/k``, ``value/i/k``, ``master/i``, the two
  records, and in format 3 ``compact/i/k/codes`` / ``compact/i/k/scales``: 1-D uint8 / fp32,
  never more elements than the param), for a param ``i`` that exists; formats 2 and 3 hold
  tensors only;
- every master has its param's shape; a state tensor has its param's shape, or is a scalar
  (``()``: Adam's ``step``, also beside a param of shape ``(1,)`` or ``()``), or has fewer
  elements than its param (factored states); a state tensor with as many elements as its
  param but another shape is refused; a record is a 1-D ``uint8`` tensor of bounded size, a
  non-tensor item (format 1) at most 16 MiB;
- sizes, before any buffer exists: every stored chunk is backed by distinct bytes of its file
  (shardkit.checkpoint's [Note: Disk-backed sizes], checked when the checkpoint is opened).
  Every buffer a load allocates is therefore backed by bytes on disk and bounded by its param
  (so a metadata declaring a huge tensor is refused, not allocated): a load allocates at most
  the state it would legitimately hold, plus records.

Without a model (``load_consolidated``) the shapes come from the commit record; with the
commit record missing and opted out of too (``allow_missing_commit_record``) only the
disk-backing bound holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from shardkit.checkpoint import Checkpoint, UnsafeCheckpointError, describe
from shardkit.optim._records import FORMAT, GROUPS_KEY, HEADER_KEY, LEGACY_FORMAT
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

__all__: list[str] = []

_LEGACY_RECORDS = ("param_groups", "shardkit_optim")
_MAX_VALUE_BYTES = 64 * 1024
_MAX_BYTES_ITEM = 16 * 1024 * 1024


@dataclass(frozen=True)
class Opened:
    """A committed optimizer checkpoint, opened safely."""

    checkpoint: Checkpoint
    """The checkpoint as shardkit.checkpoint opened it (version, metadata, commit record)."""
    record: dict[str, Any] | None
    """The commit record validated as an optimizer header; None when missing and opted out of."""
    format: str
    """``FORMAT``, ``FORMAT_2`` or ``LEGACY_FORMAT`` (the commit record's; ``FORMAT`` when a
    header record stands in for a missing one)."""

    @property
    def version(self) -> Path:
        """The version directory."""
        return self.checkpoint.version


COMPACT_PARTS = {"codes": torch.uint8, "scales": torch.float32}
"""The items of a compact moment (``compact/<i>/<key>/<part>``) and their dtypes."""


def parse_key(key: str) -> tuple[str, int, str] | None:
    """``(kind, global index, state key)`` of a per-param key (kind: state, value, master or
    compact; a compact item's state key is ``<key>/<part>``, see [Note: Compact checkpoint
    items] in ``shardkit.optim._checkpoint``)."""
    kind, sep, rest = key.partition("/")
    if not sep or kind not in ("state", "value", "master", "compact"):
        return None
    idx, _, name = rest.partition("/")
    if not (idx.isascii() and idx.isdigit()) or len(idx) > 12 or (kind == "master") == bool(name):
        return None
    if kind == "compact":
        moment, _, part = name.rpartition("/")
        if not moment or part not in COMPACT_PARTS:
            return None
    return kind, int(idx), name


def _numel(shape: tuple[int, ...]) -> int:
    """Elements of a stored shape. The checkpoint was opened, so a shape without a zero dim
    is backed by its bytes on disk and its product is small; one with a zero dim is empty
    whatever its other (untrusted) dims are."""
    return 0 if 0 in shape else math.prod(shape)


def _refuse(key: str, message: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"checkpoint item {describe(key)} {message}")


def _record_cap(n_items: int) -> int:
    return (1 << 20) + 512 * n_items


def _check_record(key: str, md: Any, cap: int) -> None:
    if (
        not isinstance(md, TensorStorageMetadata)
        or md.properties.dtype != torch.uint8
        or len(md.size) != 1
    ):
        raise _refuse(key, "is not a 1-D uint8 record; the checkpoint is damaged or crafted")
    if md.size[0] > cap:
        raise _refuse(key, f"declares {md.size[0]} bytes, more than a record may hold ({cap})")


def _check_shapes(record: dict[str, Any] | None, params: list[torch.Tensor] | None) -> None:
    if record is None or params is None:
        return
    saved = record["param_shapes"]
    if len(saved) != len(params):
        raise ValueError(
            f"the checkpoint holds {len(saved)} params but this optimizer has "
            f"{len(params)}: it was saved for a different model or param group layout."
        )
    for i, (shape, p) in enumerate(zip(saved, params, strict=True)):
        if tuple(shape) != tuple(p.shape):
            raise ValueError(
                f"param {i} was saved with shape {tuple(shape)} but has shape "
                f"{tuple(p.shape)} now: the checkpoint was saved for a different model."
            )


def _check_item(key: str, md: Any, shapes: list[tuple[int, ...]] | None, fmt: str) -> None:
    parsed = parse_key(key)
    if parsed is None:
        raise _refuse(key, f"is not an item of format {fmt}; the checkpoint is damaged or crafted")
    kind, idx, name = parsed
    if shapes is not None and idx >= len(shapes):
        raise _refuse(
            key,
            f"is for param {idx}, but this optimizer has {len(shapes)} params: it was saved for "
            f"a different model.",
        )
    if isinstance(md, BytesStorageMetadata):
        if fmt != LEGACY_FORMAT or kind == "master":
            raise _refuse(key, "holds a pickled object, which this format never writes")
        return
    if kind == "value":
        if fmt == LEGACY_FORMAT:
            raise _refuse(key, f"is not an item of format {fmt}")
        _check_record(key, md, _MAX_VALUE_BYTES)
        return
    if kind == "compact":
        if fmt != FORMAT:
            raise _refuse(key, f"is not an item of format {fmt}")
        dtype = COMPACT_PARTS[name.rpartition("/")[2]]
        if md.properties.dtype != dtype or len(md.size) != 1:
            raise _refuse(key, f"is not a 1-D {dtype} tensor; the checkpoint is damaged or crafted")
        if shapes is not None and md.size[0] > max(math.prod(shapes[idx]), 1):
            raise _refuse(
                key,
                f"declares {md.size[0]} elements for param {idx} of shape {shapes[idx]}: compact "
                f"state is never larger than its param; refused before allocating",
            )
        return
    if shapes is None:
        return
    shape, want = tuple(md.size), shapes[idx]
    numel, pnumel = _numel(shape), math.prod(want)
    if kind == "master" or (numel == pnumel and shape not in ((), want)):
        if shape != want:
            raise _refuse(
                key,
                f"has shape {shape} but param {idx} has shape {want}: the checkpoint was saved "
                f"for a different model.",
            )
    elif numel > max(pnumel, 1):
        raise _refuse(
            key,
            f"declares shape {shape} ({numel} elements) for param {idx} of shape {want} "
            f"({pnumel} elements): optimizer state is never larger than its param; refused "
            f"before allocating",
        )


def validate_against(opened: Opened, params: list[torch.Tensor] | None) -> None:
    """See [Note: Load validation]. ``params``: the optimizer's, or None (offline).

    Raises:
        ValueError: saved for another model (shapes, counts).
        UnsafeCheckpointError: anything only a damaged or crafted checkpoint holds.
    """
    _check_shapes(opened.record, params)
    metadata = opened.checkpoint.metadata
    items = metadata.state_dict_metadata
    if params is not None:
        shapes: list[tuple[int, ...]] | None = [tuple(p.shape) for p in params]
    elif opened.record is not None:
        shapes = [tuple(s) for s in opened.record["param_shapes"]]
    else:
        shapes = None
    records = (HEADER_KEY, GROUPS_KEY) if opened.format != LEGACY_FORMAT else _LEGACY_RECORDS
    for key in records:
        if key not in items:
            raise _refuse(key, "is missing; the checkpoint is damaged")
    for key, md in items.items():
        if isinstance(md, BytesStorageMetadata):
            info = metadata.storage_data[MetadataIndex(key)]
            if info.length > _MAX_BYTES_ITEM:
                raise _refuse(key, f"is a non-tensor item of {info.length} bytes")
        if key in records:
            if opened.format != LEGACY_FORMAT:
                _check_record(key, md, _record_cap(len(items)))
            elif not isinstance(md, BytesStorageMetadata):
                raise _refuse(key, "is not a pickled record")
            continue
        _check_item(key, md, shapes, opened.format)


def request(opened: Opened, wanted: set[int] | None) -> dict[str, Any]:
    """The DCP state dict to load into: buffers for the records and the wanted params' items.

    Only after :func:`validate_against`: every size here was checked there.
    """
    out: dict[str, Any] = {}
    for key, md in opened.checkpoint.metadata.state_dict_metadata.items():
        parsed = parse_key(key)
        if parsed is not None and wanted is not None and parsed[1] not in wanted:
            continue
        if isinstance(md, TensorStorageMetadata):
            out[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            out[key] = None
    return out
