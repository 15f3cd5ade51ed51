"""The one place shardkit-checkpoint names torch internals.

* ``torch.distributed.checkpoint.filesystem._StorageInfo``: the per-item storage entry (file
  name, offset, length, storage transforms) that DCP's ``FileSystemWriter`` pickles into
  ``.metadata`` and returns in every ``WriteResult``. There is no public name for it, and the
  allow-list unpickler must name every class it may build. Its fields are read as plain
  attributes (``relative_path``, ``offset``, ``length``, ``transform_descriptors``).
  ``tests/test_torch_compat.py`` pins the class and its fields, and ``tests/test_safe_reader.py::
  test_metadata_pin`` that real metadata of this torch reads back equal through the allow-list.
* ``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``: the enum ``TensorProperties``
  pickles its memory format as (pinned by the same tests).
"""

from __future__ import annotations

import dataclasses
import enum

import torch.distributed.checkpoint.filesystem as _dcp_fs
import torch.distributed.checkpoint.metadata as _dcp_md

__all__ = ["MEM_FORMAT", "STORAGE_INFO", "STORAGE_INFO_FIELDS"]


def _storage_info() -> type | None:
    cls = getattr(_dcp_fs, "_StorageInfo", None)
    return cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None


STORAGE_INFO: type | None = _storage_info()
"""DCP's per-item storage entry class (``None`` if this torch has none: every load then
refuses, naming it)."""

STORAGE_INFO_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
"""The fields of :data:`STORAGE_INFO` shardkit reads."""

MEM_FORMAT: type[enum.Enum] | None = getattr(_dcp_md, "_MEM_FORMAT_ENCODING", None)
"""The memory-format enum of ``TensorProperties``' pickled state."""
