"""Sharded optimizer checkpoints through ``torch.distributed.checkpoint`` (DCP), reshardable N -> M.

[Note: Checkpoint layout]
Every state value is stored under its own DCP key ``state/<global index>/<state key>`` (see
[Note: Global parameter index]), and with master weights every master under
``master/<global index>`` (see [Note: Master weights]); each rank writes only the keys of the
params it owns, so no rank ever holds more than its shard. ``param_groups`` (hyperparams and global indices) and a small
``shardkit_optim`` header are stored once. Loading at any world size reads DCP's metadata, asks for
the keys of the params this rank owns *now*, and feeds them to ``load_state_dict``: resharding is
a change of which keys each rank asks for, nothing else.

[Note: Crash-safe commit]
A save goes to a hidden sibling directory ``.<name>.tmp-<uuid>``. Only after DCP has finished on
every rank does the coordinator write the ``SHARDKIT_COMMIT`` marker into it and rename it to
``<name>`` (an existing checkpoint there is first renamed aside, then deleted). Loading requires
the marker, so an interrupted save leaves either the old checkpoint or a hidden temp directory
that never loads, never a half-written ``<name>``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from shardkit.optim._master import MASTER_KEY
from shardkit.partition import all_gather_objects
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

if TYPE_CHECKING:
    from shardkit.optim._sharded_optimizer import ShardedOptimizer

__all__ = ["load_consolidated", "load_sharded", "save_sharded"]

_MARKER = "SHARDKIT_COMMIT"
_FORMAT = "shardkit.optim.sharded/1"


_MASTER_PREFIX = "master/"


def _key(idx: int, name: str) -> str:
    return f"state/{idx}/{name}"


def _parse(key: str) -> tuple[int, str] | None:
    """``(global index, state key)`` of a state key, ``(global index, "")`` of a master key."""
    if key.startswith(_MASTER_PREFIX):
        return int(key[len(_MASTER_PREFIX) :]), ""
    if not key.startswith("state/"):
        return None
    _, idx, name = key.split("/", 2)
    return int(idx), name


def _require_numpy(what: str) -> None:
    """torch.distributed.checkpoint plans a distributed save/load with object collectives, which
    need NumPy (torch itself does not depend on it). Fail early and clearly instead of deep
    inside DCP on some ranks. See [Note: Object collectives without NumPy]."""
    if importlib.util.find_spec("numpy") is None:
        raise RuntimeError(
            f"{what} uses torch.distributed.checkpoint, whose distributed planning needs NumPy, "
            f"which is not installed: `pip install numpy` (or `pip install "
            f"'shardkit-optim[checkpoint]'`). consolidate_state_dict()/state_dict() work without it."
        )


def save_sharded(optimizer: ShardedOptimizer, path: str | os.PathLike[str]) -> None:
    """Saves the optimizer state as a DCP checkpoint, each rank writing its shard. Collective.

    Args:
        optimizer: the sharded optimizer (every rank of its group calls this).
        path: the checkpoint directory (replaced atomically if it exists). All ranks must see
            the same filesystem path.
    """
    _require_numpy("save_sharded")
    final = Path(path)
    group = optimizer.group
    # Rank 0's token names the temp dir on every rank. See [Note: Object collectives without NumPy].
    token = str(all_gather_objects(uuid.uuid4().hex, group)[0])
    tmp = final.parent / f".{final.name}.tmp-{token}"
    local = optimizer.local_state_dict()
    header = {
        "format": _FORMAT,
        "num_params": sum(len(g["params"]) for g in local["param_groups"]),
        "world_size": optimizer.world_size,
    }
    # Opaque bytes: DCP would otherwise flatten the nested groups into one key per value.
    sd: dict[str, Any] = {
        "param_groups": pickle.dumps(local["param_groups"]),
        "shardkit_optim": pickle.dumps(header),
    }
    for idx, entry in local["state"].items():
        for name, value in entry.items():
            sd[_key(idx, name)] = value.detach() if isinstance(value, torch.Tensor) else value
    for idx, master in local.get(MASTER_KEY, {}).items():
        sd[f"{_MASTER_PREFIX}{idx}"] = master.detach()
    if optimizer.rank == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    dist.barrier(group=group)
    _dcp_save(sd, checkpoint_id=str(tmp), process_group=group)
    dist.barrier(group=group)
    # See [Note: Crash-safe commit].
    error: str | None = None
    if optimizer.rank == 0:
        try:
            _commit(tmp, final, header, token)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    error = all_gather_objects(error, group)[0]
    if error is not None:
        raise RuntimeError(f"committing checkpoint {final} failed on rank 0: {error}")


def _commit(tmp: Path, final: Path, header: dict[str, Any], token: str) -> None:
    """Marks ``tmp`` complete and renames it to ``final``. See [Note: Crash-safe commit]."""
    with open(tmp / _MARKER, "w") as f:
        json.dump(header, f)
        f.flush()
        os.fsync(f.fileno())
    trash = final.parent / f".{final.name}.old-{token}"
    if final.exists():
        os.replace(final, trash)
    os.replace(tmp, final)
    shutil.rmtree(trash, ignore_errors=True)


def _read_metadata(path: Path) -> Any:
    if not (path / _MARKER).is_file():
        raise FileNotFoundError(
            f"{path} is not a complete shardkit.optim checkpoint: it has no {_MARKER} marker "
            f"(the save was interrupted, or this is not a checkpoint written by save_sharded)."
        )
    return FileSystemReader(str(path)).read_metadata()


def _request(metadata: Any, wanted: set[int] | None) -> dict[str, Any]:
    req: dict[str, Any] = {"param_groups": None, "shardkit_optim": None}
    for key, md in metadata.state_dict_metadata.items():
        parsed = _parse(key)
        if parsed is None or (wanted is not None and parsed[0] not in wanted):
            continue
        if isinstance(md, TensorStorageMetadata):
            req[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            req[key] = None
    return req


def _assemble(loaded: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    for key, value in loaded.items():
        parsed = _parse(key)
        if parsed is None:
            continue
        if parsed[1]:
            state.setdefault(parsed[0], {})[parsed[1]] = value
        else:
            masters[parsed[0]] = value
    header = pickle.loads(loaded["shardkit_optim"])
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise ValueError(f"unsupported checkpoint format {header!r}; expected {_FORMAT}")
    out = {
        "state": dict(sorted(state.items())),
        "param_groups": pickle.loads(loaded["param_groups"]),
    }
    if masters:
        out[MASTER_KEY] = dict(sorted(masters.items()))
    return out


def load_sharded(optimizer: ShardedOptimizer, path: str | os.PathLike[str]) -> None:
    """Loads a checkpoint written by :func:`save_sharded` at any world size. Collective.

    Each rank reads only the state of the params it owns under the current partition.

    Raises:
        FileNotFoundError: ``path`` is not a committed checkpoint.
        ValueError: the checkpoint was saved for a different model or param group layout.
    """
    _require_numpy("load_sharded")
    p = Path(path)
    metadata = _read_metadata(p)
    req = _request(metadata, set(optimizer._layout.owned(optimizer.rank)))
    _dcp_load(req, checkpoint_id=str(p), process_group=optimizer.group)
    optimizer.load_state_dict(_assemble(req))


def load_consolidated(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a sharded checkpoint offline (one process, no process group) as one plain dict.

    The result loads into the plain torch optimizer class that was sharded.
    """
    p = Path(path)
    metadata = _read_metadata(p)
    req = _request(metadata, None)
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process, which is exactly the intent here.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        _dcp_load(req, checkpoint_id=str(p), no_dist=True)
    return _assemble(req)
