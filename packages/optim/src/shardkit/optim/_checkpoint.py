"""Sharded optimizer checkpoints through ``torch.distributed.checkpoint`` (DCP), reshardable N -> M.

[Note: Checkpoint layout]
Every state value is stored under its own DCP key ``state/<global index>/<state key>`` (see
[Note: Global parameter index]), and with master weights every master under
``master/<global index>`` (see [Note: Master weights]); each rank writes only the keys of the
params it owns, so no rank ever holds more than its shard. ``param_groups`` (hyperparams and global indices) and a small
``shardkit_optim`` header are stored once. Loading at any world size reads DCP's metadata, asks for
the keys of the params this rank owns *now*, and feeds them to ``load_state_dict``: resharding is
a change of which keys each rank asks for, nothing else.

The commit and its crash safety: [Note: Atomic commit] in ``_commit.py``; checksums: [Note:
Checkpoint checksums]; shape validation before loading: [Note: Load validation] below.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from shardkit.optim import _commit
from shardkit.optim._commit import Staging, checksum, read_header, resolve, verify_checksums
from shardkit.optim._master import MASTER_KEY
from shardkit.partition import all_gather_objects
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

if TYPE_CHECKING:
    from shardkit.optim._sharded_optimizer import ShardedOptimizer

__all__ = ["load_consolidated", "load_sharded", "save_sharded"]

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

    The new checkpoint replaces the one at ``path`` atomically (see [Note: Atomic commit]):
    a crash at any point leaves the old or the new checkpoint loadable there.

    Args:
        optimizer: the sharded optimizer (every rank of its group calls this).
        path: the checkpoint directory. All ranks must see the same filesystem path.

    Raises:
        RuntimeError: the save failed on some rank, or the files of some rank are not visible
            where the checkpoint is committed (raised on every rank; nothing is committed and
            the staging directory is removed).
    """
    _require_numpy("save_sharded")
    final = Path(path)
    group = optimizer.group
    coordinator = optimizer.rank == 0
    # Rank 0 names the save and decides where it stages; every rank writes there.
    # See [Note: Object collectives without NumPy].
    staging: Staging | None = Staging(final, uuid.uuid4().hex) if coordinator else None
    plan = all_gather_objects(
        None if staging is None else (staging.token, str(staging.stage)), group
    )[0]
    token, stage = str(plan[0]), Path(plan[1])
    local = optimizer.local_state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    header: dict[str, Any] = {
        "format": _FORMAT,
        "num_params": len(params),
        "param_shapes": [list(p.shape) for p in params],
        "world_size": optimizer.world_size,
        "token": token,
    }
    # Opaque bytes: DCP would otherwise flatten the nested groups into one key per value.
    sd: dict[str, Any] = {
        "param_groups": pickle.dumps(local["param_groups"]),
        "shardkit_optim": pickle.dumps({k: v for k, v in header.items() if k != "param_shapes"}),
    }
    for idx, entry in local["state"].items():
        for name, value in entry.items():
            sd[_key(idx, name)] = value.detach() if isinstance(value, torch.Tensor) else value
    for idx, master in local.get(MASTER_KEY, {}).items():
        sd[f"{_MASTER_PREFIX}{idx}"] = master.detach()
    error: str | None = None
    if staging is not None:
        try:
            staging.prepare()
        except OSError as e:
            error = f"preparing {staging.stage} failed: {type(e).__name__}: {e}"
    _agreed_error(error, group, f"save_sharded({final})")
    error = None
    try:
        _dcp_save(sd, checkpoint_id=str(stage), process_group=group)
        _commit.crash_point("written")
    except Exception as e:  # every rank must reach the agreement below
        error = f"rank {optimizer.rank}: {type(e).__name__}: {e}"
    # See [Note: Checkpoint checksums].
    sums = {k: checksum(v) for k, v in sd.items() if isinstance(v, (torch.Tensor, bytes))}
    gathered = all_gather_objects((error, sums), group)
    errors = [str(e) for e, _ in gathered if e is not None]
    if staging is not None:
        if not errors:
            header["checksums"] = {k: v for _, part in gathered for k, v in part.items()}
            try:
                staging.commit(header)
            except OSError as e:
                errors.append(f"committing on rank 0 failed: {type(e).__name__}: {e}")
        if errors:
            staging.abort()
    _agreed_error(errors[0] if errors else None, group, f"save_sharded({final})")


def _agreed_error(error: str | None, group: dist.ProcessGroup, what: str) -> None:
    """Raises the same error on every rank if any rank has one (a collective)."""
    errors = [e for e in all_gather_objects(error, group) if e is not None]
    if errors:
        raise RuntimeError(f"{what} failed, nothing was committed: {errors[0]}")


def _open(path: Path) -> tuple[Path, Any, dict[str, Any]]:
    """(version directory, DCP metadata, marker header) of the committed checkpoint."""
    version = resolve(path)
    header = read_header(version)
    return version, FileSystemReader(str(version)).read_metadata(), header


# [Note: Load validation]
# Every rank checks the whole checkpoint against its params before anything is read or any
# state is touched, on information all ranks share (the marker's param shapes and DCP's
# metadata), so a mismatch raises the same error on every rank instead of only on the owner
# of the mismatching entry (whose peers would then wait in the next collective): the number of
# params, every param's shape exactly (including the number of dims and size-1 dims), every
# master's shape, and every state tensor with as many elements as its param must have its
# shape exactly. A checkpoint from shardkit-optim 0.1 has no param shapes in its marker; its
# state tensors are still checked against the current params.
def _validate(metadata: Any, header: dict[str, Any], params: list[torch.Tensor]) -> None:
    saved = header.get("param_shapes")
    if saved is not None:
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
    for key, md in metadata.state_dict_metadata.items():
        parsed = _parse(key)
        if parsed is None or not isinstance(md, TensorStorageMetadata):
            continue
        idx, name = parsed
        if not 0 <= idx < len(params):
            raise ValueError(
                f"checkpoint item {key!r} is for param {idx}, but this optimizer has "
                f"{len(params)} params: it was saved for a different model."
            )
        shape, want = tuple(md.size), tuple(params[idx].shape)
        numel = 1
        for d in shape:
            numel *= d
        if (not name or numel == params[idx].numel()) and shape != want:
            raise ValueError(
                f"checkpoint item {key!r} has shape {shape} but param {idx} has shape {want}: "
                f"the checkpoint was saved for a different model."
            )


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

    Each rank reads only the state of the params it owns under the current partition, after
    every rank checked the whole checkpoint against the params (see [Note: Load validation]);
    every item read is checked against its saved checksum.

    Raises:
        FileNotFoundError: ``path`` is not a committed checkpoint.
        ValueError: the checkpoint was saved for a different model or param group layout, or
            an item fails its checksum (on every rank, naming the item).
    """
    _require_numpy("load_sharded")
    group = optimizer.group
    error: str | None = None
    try:
        version, metadata, header = _open(Path(path))
        params = [p for g in optimizer.param_groups for p in g["params"]]
        _validate(metadata, header, params)
    except (FileNotFoundError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    # Every rank decides the same way from shared files, but a rank that cannot see them (no
    # shared filesystem) must not leave the others waiting in DCP's collectives.
    errors = [e for e in all_gather_objects(error, group) if e is not None]
    if errors:
        kind, _, message = errors[0].partition(": ")
        raise (FileNotFoundError if kind == "FileNotFoundError" else ValueError)(message)
    req = _request(metadata, set(optimizer._layout.owned(optimizer.rank)))
    _dcp_load(req, checkpoint_id=str(version), process_group=group)
    bad = verify_checksums(req, header.get("checksums", {}), lambda key: _where(metadata, key))
    bad_all = [b for b in all_gather_objects(bad, group) if b is not None]
    if bad_all:
        raise ValueError(f"load_sharded({path}): {bad_all[0]}")
    optimizer.load_state_dict(_assemble(req))


def _where(metadata: Any, key: str) -> str:
    """The file holding ``key``'s data, for error messages."""
    files = sorted(
        {str(info.relative_path) for idx, info in (metadata.storage_data or {}).items()
         if getattr(idx, "fqn", None) == key}
    )  # fmt: skip
    return f"file {', '.join(files)}" if files else "file unknown"


def load_consolidated(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a sharded checkpoint offline (one process, no process group) as one plain dict.

    The result loads into the plain torch optimizer class that was sharded. Every item is
    checked against its saved checksum.

    Raises:
        FileNotFoundError: ``path`` is not a committed checkpoint.
        ValueError: an item fails its checksum.
    """
    version, metadata, header = _open(Path(path))
    req = _request(metadata, None)
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process, which is exactly the intent here.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        _dcp_load(req, checkpoint_id=str(version), no_dist=True)
    bad = verify_checksums(req, header.get("checksums", {}), lambda key: _where(metadata, key))
    if bad is not None:
        raise ValueError(f"load_consolidated({path}): {bad}")
    return _assemble(req)
