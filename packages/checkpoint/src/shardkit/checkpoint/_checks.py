"""What :func:`shardkit.checkpoint.load` checks against the destination before reading anything.

[Note: Load checks]
DCP copies stored data into the tensors of the state dict it is given and refuses a tensor
whose global shape differs, but it casts another dtype silently, replaces a destination tensor
by whatever object a non-tensor item holds, and raises an untyped error deep in planning for a
missing key. Before any payload is read or any buffer allocated, on every rank (DCP's planning
gathers every rank's failure), ``load`` checks every entry of the destination (flattened the
way DCP flattens it, ``model.layer.weight``) against the checkpoint's metadata, read safely:

- the key is in the checkpoint (unless ``allow_partial_load``);
- a destination tensor (plain, ``DTensor`` or ``ShardedTensor``: their global shape) has a
  stored tensor of the same shape and dtype;
- a destination non-tensor value has a stored non-tensor item (decoded by the weights-only
  loader, see [Note: Safe DCP reading]);
- a destination ``None`` where the checkpoint holds a plain tensor (e.g. a record whose length
  the caller cannot know) is replaced by a tensor of the stored shape and dtype, allocated only
  after the reader checked that its bytes are on disk.

Every stored chunk is backed by its bytes on disk (see [Note: Disk-backed sizes]), so what a
load allocates beyond the destination's own tensors is bounded by the files it reads.
"""

from __future__ import annotations

from typing import Any

import torch
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import CheckpointMismatchError
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

__all__ = ["CheckedLoadPlanner", "check_destination"]


def _missing(metadata: Metadata, state_dict: dict[str, Any]) -> list[str]:
    return [k for k in state_dict if k not in metadata.state_dict_metadata]


def check_destination(
    metadata: Metadata, state_dict: dict[str, Any], *, allow_partial_load: bool = False
) -> None:
    """See [Note: Load checks]. ``state_dict``: flattened as DCP flattens it.

    Raises:
        CheckpointMismatchError: naming the first entries that do not fit (up to 5).
    """
    problems: list[str] = []
    missing = _missing(metadata, state_dict)
    if missing and not allow_partial_load:
        problems.append(
            f"{len(missing)} key(s) of the state dict are not in the checkpoint: "
            f"{', '.join(describe(k) for k in missing[:5])}"
        )
    for key, obj in state_dict.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            continue
        if isinstance(obj, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(
                    f"{key!r} is a tensor in the state dict but a non-tensor value in the "
                    f"checkpoint"
                )
                continue
            shape, dtype = tuple(obj.size()), obj.dtype
            if shape != tuple(md.size) or dtype != md.properties.dtype:
                problems.append(
                    f"{key!r} has shape {shape} and dtype {dtype} in the state dict but "
                    f"{tuple(md.size)} and {md.properties.dtype} in the checkpoint"
                )
        elif isinstance(md, TensorStorageMetadata):
            problems.append(
                f"{key!r} is a {type(obj).__name__} in the state dict but a tensor of shape "
                f"{tuple(md.size)} in the checkpoint"
            )
        if len(problems) >= 5:
            break
    if problems:
        raise CheckpointMismatchError(
            f"the checkpoint does not fit the state dict: {'; '.join(problems)}. Load it into a "
            f"state dict of the saved model and optimizer (same keys, shapes and dtypes), then "
            f"convert; shardkit.checkpoint.inspect(path) lists what it holds."
        )


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, checking the destination first (see [Note: Load checks])."""

    def _fill(self, metadata: Metadata) -> None:
        """Stored tensors for the destination's ``None`` values (in the flat and the nested
        state dict: ``mappings`` holds each flat key's path)."""
        for key, obj in list(self.state_dict.items()):
            md = metadata.state_dict_metadata.get(key)
            if obj is not None or not isinstance(md, TensorStorageMetadata):
                continue
            t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            self.state_dict[key] = t
            path = self.mappings.get(key, (key,)) if self.flatten_state_dict else (key,)
            node: Any = self.original_state_dict
            for part in path[:-1]:
                node = node[part]
            node[path[-1]] = t

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise RuntimeError("CheckedLoadPlanner: set_up_planner was not called")
        self._fill(self.metadata)  # after the reader's storage check: see [Note: Disk-backed sizes]
        plan: LoadPlan | None = None
        if _missing(self.metadata, self.state_dict) and not self.allow_partial_load:
            # a checkpoint of torch <= 2.3 flattens some keys differently; DCP's planner maps
            # them (or raises for keys that are really missing, reported below)
            try:
                plan = super().create_local_plan()
            except (RuntimeError, ValueError):
                plan = None
        check_destination(
            self.metadata, self.state_dict, allow_partial_load=self.allow_partial_load
        )
        return plan if plan is not None else super().create_local_plan()
