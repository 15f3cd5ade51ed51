"""Pins the torch internals named in ``shardkit.checkpoint._torch_compat``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from shardkit.checkpoint._torch_compat import MEM_FORMAT, STORAGE_INFO, STORAGE_INFO_FIELDS
from shardkit.checkpoint._unpickle import restricted_loads


def test_storage_info_is_what_dcp_writes(tmp_path: Path) -> None:
    """DCP's FileSystemWriter pickles one _StorageInfo per item, with the fields read here."""
    assert STORAGE_INFO is not None and dataclasses.is_dataclass(STORAGE_INFO)
    names = {f.name for f in dataclasses.fields(STORAGE_INFO)}
    assert set(STORAGE_INFO_FIELDS) <= names
    dcp.save({"w": torch.ones(3), "n": 1}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    md = restricted_loads((tmp_path / "c" / ".metadata").read_bytes(), "m")
    infos = list(md.storage_data.values())
    assert infos and all(type(i) is STORAGE_INFO for i in infos)
    assert all(isinstance(i.relative_path, str) and i.length > 0 for i in infos)


def test_memory_format_encoding_is_an_enum() -> None:
    assert MEM_FORMAT is not None
    assert {m.name for m in MEM_FORMAT} >= {"TORCH_CONTIGUOUS_FORMAT"}
