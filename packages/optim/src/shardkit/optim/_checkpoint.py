"""Sharded optimizer checkpoints through ``torch.distributed.checkpoint`` (DCP), reshardable N -> M.

[Note: Checkpoint layout]
Every state tensor is stored under its own DCP key ``state/<global index>/<state key>`` (see
[Note: Global parameter index]), every non-tensor state value as a JSON record under
``value/<global index>/<state key>``, and with master weights every master under
``master/<global index>`` (see [Note: Master weights]); each rank writes only the keys of the
params it owns, so no rank ever holds more than its shard. ``shardkit/param_groups``
(hyperparams and global indices) and ``shardkit/header`` are JSON records stored once (see
[Note: Optimizer checkpoint records]). Loading at any world size reads DCP's metadata, asks for
the keys of the params this rank owns *now*, and feeds them to ``load_state_dict``: resharding
is a change of which keys each rank asks for, nothing else.

The save and the reading ride on shardkit.checkpoint, through its public API: the commit and
its crash safety ([Note: Atomic commit]), the CRC-32 of every stored chunk ([Note: Checkpoint
checksums]), reading untrusted files ([Note: Safe DCP reading]). What this module adds: the
optimizer's items and records, the item CRC-32s of its header (which shardkit-optim 0.3 and
earlier wrote instead, and which verify a checkpoint whose commit record was lost), and what a
load checks against the params ([Note: Load validation] in ``_load_checks.py``). What an
optimizer must expose to be checkpointed: :class:`ShardedCheckpointable`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
import uuid
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from shardkit.checkpoint import (
    CheckpointSaveError,
    ChecksumError,
    Outcome,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    agreed_error,
    checksum,
    describe,
    open_checkpoint,
    outcome,
    save,
    to_record,
)
from shardkit.optim._agreement import (
    LOAD_SHARDED_CALL,
    SAVE_SHARDED_CALL,
    agree_call,
    agree_outcome,
)
from shardkit.optim._compact import CompactFormat, CompactTensor
from shardkit.optim._compact_optim import dequantize_state_dict
from shardkit.optim._load_checks import Opened, parse_key, request, validate_against
from shardkit.optim._master import MASTER_KEY
from shardkit.optim._records import (
    FORMAT,
    GROUPS_KEY,
    HEADER_KEY,
    LEGACY_FORMAT,
    VALUE_PREFIX,
    decode_groups,
    decode_value,
    encode_groups,
    encode_value,
    from_tensor,
    validate_header,
)
from shardkit.optim._state import global_params
from shardkit.partition import all_gather_objects
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load

__all__ = ["ShardedCheckpointable", "load_consolidated", "load_sharded", "save_sharded"]

logger = logging.getLogger("shardkit.optim")


@runtime_checkable
class ShardedCheckpointable(Protocol):
    """What an optimizer exposes to :func:`save_sharded` and :func:`load_sharded` (implemented
    by :class:`ShardedOptimizer`): every rank of ``group`` holds part of the state, addressed by
    global parameter indices (see [Note: Global parameter index]).
    """

    group: dist.ProcessGroup
    """The process group whose ranks share the state (every rank of it saves and loads)."""
    rank: int
    """This rank in ``group``."""
    world_size: int
    """The size of ``group``."""
    param_groups: list[dict[str, Any]]
    """The param groups; their params in order define the global indices."""

    @property
    def collective_timeout(self) -> timedelta | None:
        """How long a rank waits for the others to enter a save or load (``None``: the
        process group's timeout)."""

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's part, ``{"state": {global index: state}, "param_groups": [...]}`` (plus
        ``"master_params": {global index: tensor}``), every index on exactly one rank.
        Called on every rank (it may be collective)."""

    def checkpoint_indices(self) -> list[int]:
        """The global indices whose saved state this rank loads."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a plain state dict holding (at least) the state of
        :meth:`checkpoint_indices`, and every param group."""


_MASTER_PREFIX = "master/"

# The messages of the checkpoint functions' agreements (see :func:`agreed_error`): a load raises
# the failing rank's own message, at most 2000 characters of it.
_NOT_COMMITTED = "{what} failed, nothing was committed: {message}"
_AS_IS = "{message:.2000}"
_PREFIXED = "{what}: {message:.2000}"
_ALONE = "{what}: {message}"  # load_consolidated: one process, the whole message


def _failed(message: str) -> Outcome:
    """A failed save's outcome: raised as a ``CheckpointSaveError`` on every rank."""
    return CheckpointSaveError.__name__, message


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


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with a storage of exactly its bytes (``torch.save`` writes a view's whole
    storage, which a load would then refuse as oversized: see [Note: Safe DCP reading])."""
    t = t.detach()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


# [Note: Compact checkpoint items]
# Format 3 (``shardkit.optim.sharded/3``) is format 2 plus compact moments stored as they are
# held (``compact_state``: [Note: Compact state under ZeRO-1]): for a ``CompactTensor`` value of
# param ``i``'s state key ``k``, the items ``compact/i/k/codes`` (uint8, the param's code bytes
# on its global flat index) and ``compact/i/k/scales`` (fp32, one per block), beside the JSON
# record ``value/i/k`` = ``{"compact": {"map": ..., "block": ...}}``. A checkpoint of a compact
# optimizer is then about a quarter (int8) or an eighth (int4) of format 2's moment bytes, and no
# rank dequantizes anything to save. Loading reassembles the ``CompactTensor`` (its sizes checked
# against the param: a mismatch is a crafted checkpoint) and hands it to ``load_state_dict``:
# a compact optimizer of the same kind keeps the bits (any world size: blocks live on the global
# index, a ZeRO-2 piece is a byte range of them), another kind re-quantizes from the values, and
# a plain optimizer (or ``load_consolidated``, whose dict is for plain torch) gets fp32 moments.
# Formats 1 and 2 still load; a compact optimizer quantizes their fp32 moments once.
_COMPACT_PREFIX = "compact/"


def _compact_items(idx: int, name: str, value: CompactTensor) -> dict[str, torch.Tensor]:
    """The items of one compact moment: see [Note: Compact checkpoint items]."""
    where = f"optimizer state of param {idx}, key {name!r}"
    record = {"compact": {"map": value.fmt.map_name, "block": value.fmt.block}}
    return {
        f"{_COMPACT_PREFIX}{idx}/{name}/codes": _own_storage(value.codes),
        f"{_COMPACT_PREFIX}{idx}/{name}/scales": _own_storage(value.scales),
        f"{VALUE_PREFIX}{idx}/{name}": encode_value(record, where),
    }


def _local_items(local: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's DCP items (state tensors, compact moments, value records, masters). Raises
    TypeError for a state value that is neither a tensor nor JSON-like."""
    sd: dict[str, torch.Tensor] = {}
    for idx, entry in local["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                sd[f"state/{idx}/{name}"] = _own_storage(value)
            elif isinstance(value, CompactTensor):
                sd.update(_compact_items(idx, name, value))
            else:
                where = f"optimizer state of param {idx}, key {name!r}"
                sd[f"{VALUE_PREFIX}{idx}/{name}"] = encode_value(value, where)
    for idx, master in local.get(MASTER_KEY, {}).items():
        sd[f"{_MASTER_PREFIX}{idx}"] = _own_storage(master)
    return sd


def save_sharded(optimizer: ShardedCheckpointable, path: str | os.PathLike[str]) -> None:
    """Saves the optimizer state as a DCP checkpoint, each rank writing its shard. Collective.

    The new checkpoint replaces the one at ``path`` atomically (see [Note: Atomic commit]):
    a crash at any point leaves the old or the new checkpoint loadable there. It is written in
    format ``shardkit.optim.sharded/3``: tensors and JSON records only, nothing pickled of
    shardkit's own (see ``docs/security.md``), compact moments as their codes and scales
    ([Note: Compact checkpoint items]), through :func:`shardkit.checkpoint.save` (the
    CRC-32 of every stored chunk in the commit record).

    Args:
        optimizer: the sharded optimizer (every rank of its group calls this).
        path: the checkpoint directory. All ranks must see the same filesystem path.

    Raises:
        CheckpointSaveError: (a ``RuntimeError``) the save failed on some rank (e.g. a state
            value that is neither a tensor nor JSON-like), or the files of some rank are not
            visible where the checkpoint is committed (raised on every rank; nothing is
            committed and the staging directory is removed).
    """
    _require_numpy("save_sharded")
    group = optimizer.group
    # Every rank in this call, within collective_timeout: see [Note: Call agreement].
    agree_call(SAVE_SHARDED_CALL, group, optimizer.collective_timeout)
    final = Path(path)
    what = f"save_sharded({final})"
    local = optimizer.local_state_dict()
    params = global_params(optimizer.param_groups)
    error: Outcome = None
    sd: dict[str, torch.Tensor] = {}
    try:
        sd = _local_items(local)
        sd[GROUPS_KEY] = encode_groups(local["param_groups"])
    except TypeError as e:
        error = _failed(f"rank {optimizer.rank}: {e}")
    # Rank 0 names the save. The header record carries every item's CRC-32 ([Note: Commit
    # record required]), so every rank needs all of them before DCP writes: one gather of
    # every rank's outcome and checksums. See [Note: Object collectives without NumPy].
    token = uuid.uuid4().hex if optimizer.rank == 0 else None
    sums = {k: checksum(v) for k, v in sd.items()}
    gathered = all_gather_objects((token, error, sums), group)
    failure = agreed_error([e for _, e, _ in gathered], what, template=_NOT_COMMITTED)
    if failure is not None:
        raise failure
    token = str(gathered[0][0])
    header: dict[str, Any] = {
        "format": FORMAT,
        "num_params": len(params),
        "param_shapes": [list(p.shape) for p in params],
        "world_size": optimizer.world_size,
        "token": token,
        "checksums": dict(sorted((k, v) for _, _, part in gathered for k, v in part.items())),
    }
    sd[HEADER_KEY] = to_record(header, HEADER_KEY)
    record = dict(header, checksums={**header["checksums"], HEADER_KEY: checksum(sd[HEADER_KEY])})
    try:
        save(sd, final, process_group=group, record=record, token=token)
    except CheckpointSaveError as e:  # raised on every rank alike
        raise CheckpointSaveError(_NOT_COMMITTED.format(what=what, message=e.detail)) from None


def _open(path: Path, allow_pickle: bool, allow_missing_commit_record: bool) -> Opened:
    """The committed version, its safely read metadata and its commit record, validated as an
    optimizer header.

    Raises:
        FileNotFoundError / ValueError: see :func:`load_sharded`.
    """
    ck = open_checkpoint(path, allow_missing_commit_record=allow_missing_commit_record)
    record: dict[str, Any] | None = None
    if ck.record is not None:
        try:
            where = str(ck.version / "SHARDKIT_COMMIT")
            record = validate_header(ck.record, where, legacy_ok=True)
        except ValueError as e:
            if not allow_missing_commit_record:
                raise
            logger.warning(
                "loading %s without its commit record (allow_missing_commit_record=True): %s",
                path,
                str(e).split(";")[0],
            )
    keys = ck.metadata.state_dict_metadata
    fmt = (
        record["format"]
        if record is not None
        else (FORMAT if HEADER_KEY in keys else LEGACY_FORMAT)
    )
    if fmt == LEGACY_FORMAT and not allow_pickle:
        raise UnsafeCheckpointError(
            f"{path} is a checkpoint of format {LEGACY_FORMAT} (shardkit-optim <= 0.1.8), whose "
            f"records are pickles: loading it runs whatever code they contain. Pass "
            f"allow_pickle=True only if you trust who wrote it, then save it again to convert "
            f"it to {FORMAT}."
        )
    if fmt == LEGACY_FORMAT:
        logger.warning(
            "loading %s of format %s with allow_pickle=True: its records are unpickled; save it "
            "again to convert it to %s",
            path,
            LEGACY_FORMAT,
            FORMAT,
        )
    return Opened(ck, record, fmt)


def _where(metadata: Any, key: str) -> str:
    """The file holding ``key``'s data, for error messages."""
    files = sorted(
        {str(info.relative_path) for idx, info in metadata.storage_data.items() if idx.fqn == key}
    )
    return f"file {', '.join(files)}" if files else "file unknown"


def _verify_items(
    loaded: dict[str, Any], expected: dict[str, int], where: Callable[[str], str], strict: bool
) -> None:
    """Every item of ``loaded`` matches its CRC-32 in ``expected`` (with ``strict``, every
    tensor item has one). See [Note: Optimizer checkpoint records].

    Raises:
        ChecksumError: naming the first item that fails.
    """
    for key, value in loaded.items():
        want = expected.get(key)
        if want is None and strict and isinstance(value, torch.Tensor):
            raise ChecksumError(
                f"item {describe(key)} ({where(key)}) has no saved checksum: it was not part of "
                f"the save"
            )
        if want is None or value is None:
            continue
        got = checksum(value)
        if got != want:
            raise ChecksumError(
                f"item {describe(key)} ({where(key)}) fails its checksum (crc32 {got:#010x}, "
                f"saved {want:#010x}): the file was modified or corrupted after the save"
            )


def _verify_and_assemble(opened: Opened, loaded: dict[str, Any]) -> dict[str, Any]:
    """Checks every loaded item against its checksum, then decodes the plain state dict.

    See [Note: Commit record required] for where the checksums come from.

    Raises:
        ValueError: an item fails its checksum, or a record fails its schema.
    """
    metadata = opened.checkpoint.metadata
    where = lambda key: _where(metadata, key)  # noqa: E731
    if opened.format == LEGACY_FORMAT:
        sums = opened.record.get("checksums", {}) if opened.record is not None else {}
        _verify_items(loaded, sums, where, strict=False)
        return _assemble_legacy(loaded)
    record_sums = opened.record["checksums"] if opened.record is not None else None
    if record_sums is not None:
        _verify_items({HEADER_KEY: loaded[HEADER_KEY]}, record_sums, where, strict=True)
    header = validate_header(from_tensor(loaded[HEADER_KEY], HEADER_KEY), HEADER_KEY)
    if opened.record is not None and header["token"] != opened.record["token"]:
        raise UnsafeCheckpointError(
            f"{HEADER_KEY} belongs to save {header['token']}, the commit record to "
            f"{opened.record['token']}: files of two checkpoints were mixed"
        )
    sums = record_sums if record_sums is not None else header["checksums"]
    missing = sorted(set(sums) - set(metadata.state_dict_metadata) - {HEADER_KEY})
    if missing:
        raise UnsafeCheckpointError(
            f"{len(missing)} saved item(s) are not in the checkpoint's metadata (first: "
            f"{describe(missing[0])}); the checkpoint is damaged or crafted"
        )
    rest = {k: v for k, v in loaded.items() if k != HEADER_KEY}
    _verify_items(rest, sums, where, strict=True)
    groups = lambda: decode_groups(loaded[GROUPS_KEY], header["num_params"])  # noqa: E731
    shapes = [tuple(s) for s in header["param_shapes"]]
    return _plain(rest, groups, decode=True, shapes=shapes)


def _assemble_legacy(loaded: dict[str, Any]) -> dict[str, Any]:
    """Format 1: pickled records (the caller opted in with ``allow_pickle=True``)."""
    header = pickle.loads(loaded["shardkit_optim"])  # opted in: see allow_pickle
    if not isinstance(header, dict) or header.get("format") != LEGACY_FORMAT:
        raise ValueError(
            f"unsupported checkpoint format {describe(header)}; expected {LEGACY_FORMAT}"
        )
    groups = lambda: pickle.loads(loaded["param_groups"])  # noqa: E731 (opted in: allow_pickle)
    return _plain(loaded, groups, decode=False)


def _plain(
    items: dict[str, Any],
    groups: Callable[[], Any],
    *,
    decode: bool,
    shapes: list[tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """The plain state dict of the loaded items (``state``, ``param_groups``, the masters).

    Args:
        items: the loaded items; those that are not per-param (see ``parse_key``) are ignored.
        groups: makes ``param_groups`` (called after every per-param item is decoded).
        decode: decode the ``value/`` items (format 2's JSON records); format 1 holds values.
        shapes: the params' shapes (the header's), for compact moments (format 3).

    Raises:
        UnsafeCheckpointError: compact items that do not make a compact moment of their param.
    """
    state: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in items.items():
        parsed = parse_key(key)
        if parsed is None:
            continue
        kind, idx, name = parsed
        if kind == "master":
            masters[idx] = value
        elif kind == "compact":
            moment, _, part = name.rpartition("/")
            parts.setdefault((idx, moment), {})[part] = value
        else:
            state.setdefault(idx, {})[name] = (
                decode_value(value, key) if decode and kind == "value" else value
            )
    for (idx, moment), got in parts.items():
        state[idx][moment] = _compact_moment(idx, moment, got, state, shapes)
    out: dict[str, Any] = {"state": dict(sorted(state.items())), "param_groups": groups()}
    if masters:
        out[MASTER_KEY] = dict(sorted(masters.items()))
    return out


def _compact_moment(
    idx: int,
    moment: str,
    got: dict[str, torch.Tensor],
    state: dict[int, dict[str, Any]],
    shapes: list[tuple[int, ...]] | None,
) -> CompactTensor:
    """One compact moment from its items; see [Note: Compact checkpoint items]."""
    where = f"compact optimizer state of param {idx}, key {moment!r}"
    record = state.get(idx, {}).get(moment)
    spec = record.get("compact") if isinstance(record, dict) else None
    if (
        shapes is None
        or idx >= len(shapes)
        or set(got) != {"codes", "scales"}
        or not isinstance(spec, dict)
        or set(spec) != {"map", "block"}
    ):
        raise UnsafeCheckpointError(
            f"{where}: its items ({sorted(got)}) and record ({describe(record)}) do not make a "
            f"compact moment; the checkpoint is damaged or crafted"
        )
    try:
        fmt = CompactFormat(spec["map"], spec["block"])
        return CompactTensor(got["codes"], got["scales"], shapes[idx], fmt)
    except (TypeError, ValueError) as e:
        raise UnsafeCheckpointError(f"{where}: {e}; the checkpoint is damaged or crafted") from None


def _reader(opened: Opened, allow_pickle: bool) -> SafeFileSystemReader:
    return opened.checkpoint.reader(allow_pickle=allow_pickle and opened.format == LEGACY_FORMAT)


def _first_failure(e: BaseException) -> tuple[BaseException, int | None]:
    """``e``, or the first failing rank's exception of DCP's CheckpointException."""
    failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(inner, BaseException):
            return inner, rank
    return e, None


def _read_error(e: BaseException, what: str) -> ValueError:
    """The error of a failed read: shardkit.checkpoint's own type (a CRC-32 mismatch, a crafted
    item), else ``UnsafeCheckpointError``; the same on every rank (DCP gathers every rank's)."""
    inner, rank = _first_failure(e)
    text = f"{type(inner).__name__}: {str(inner)[:2000]}"
    text += "" if rank is None else f" (rank {rank})"
    if isinstance(inner, UnsafeCheckpointError):
        return type(inner)(f"{what}: {text}")
    return UnsafeCheckpointError(
        f"{what}: reading the checkpoint failed, it is damaged or crafted: {text}"
    )


def _read_verified(
    opened: Opened,
    req: dict[str, Any],
    what: str,
    allow_pickle: bool,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """Reads the items of ``req`` through the safe reader, checks them against their checksums
    and decodes the plain state dict: collectively over ``group``, or in this one process.

    Raises:
        ValueError: (``UnsafeCheckpointError`` for what only a damaged or crafted checkpoint
            holds) reading failed, an item fails its checksum or a record its schema; with
            ``group`` on every rank of it, whichever rank found it.
    """
    reader = _reader(opened, allow_pickle)
    try:
        if group is not None:
            _dcp_load(req, storage_reader=reader, process_group=group)
        else:
            with warnings.catch_warnings():
                # DCP warns that it assumes a single process, which is exactly the intent here.
                warnings.filterwarnings(
                    "ignore", message=".*assuming the intent is to load in a single"
                )
                _dcp_load(req, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # with a group: on every rank (gathered)
        raise _read_error(e, what) from None
    error: ValueError | None = None
    assembled: dict[str, Any] | None = None
    try:
        assembled = _verify_and_assemble(opened, req)
    except ValueError as e:
        error = e
    if group is not None:
        # Each rank reads only the items of the params it owns: one rank may find a damaged
        # one alone, and every rank must refuse the load.
        agree_outcome(outcome(error), group, what, template=_PREFIXED, default=ValueError)
    else:
        failure = agreed_error([outcome(error)], what, template=_ALONE, default=ValueError)
        if failure is not None:
            raise failure from None
    if assembled is None:  # unreachable: no rank reported an error
        raise RuntimeError(f"{what}: internal error, the checkpoint was not assembled")
    return assembled


def load_sharded(
    optimizer: ShardedCheckpointable,
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    allow_missing_commit_record: bool = False,
) -> None:
    """Loads a checkpoint written by :func:`save_sharded` at any world size. Collective.

    Safe on untrusted checkpoints (see ``docs/security.md``): nothing in the checkpoint is
    unpickled outside an allow-list, and before any buffer is allocated every rank checks the
    whole checkpoint against the params: keys, shapes, dtypes, byte counts and the sizes of the
    files (see [Note: Load validation]). Each rank then reads only the state of the params it
    owns under the current partition; every item read is checked against its saved checksum.

    Args:
        optimizer: the sharded optimizer (every rank of its group calls this).
        path: the checkpoint directory.
        allow_pickle: also load a checkpoint of format ``shardkit.optim.sharded/1`` (written by
            shardkit-optim <= 0.1.8), whose records are pickles: this UNPICKLES them (with DCP's
            ``torch.load(weights_only=False)`` and ``pickle.loads``), which runs any code a
            crafted checkpoint contains. Only for checkpoints you trust; save it again to
            convert it. Format-2 checkpoints never unpickle anything of their own.
        allow_missing_commit_record: also load a checkpoint whose commit record
            (``SHARDKIT_COMMIT``) is missing, empty or unreadable (refused by default). A
            format-2 checkpoint is then still verified item by item against the checksums of
            its ``shardkit/header`` record (which itself is only checked against its schema);
            a format-1 or shardkit-optim 0.1 checkpoint has no other checksums and loads
            UNVERIFIED: a corrupted payload loads silently.

    Raises:
        FileNotFoundError: ``path`` is not a committed checkpoint.
        ValueError: (``UnsafeCheckpointError`` for what only a damaged or crafted checkpoint
            holds) the checkpoint was saved for a different model or param group layout, an
            item fails its checksum, a record fails its schema, sizes do not fit, or it needs
            an opt-in above. Raised on every rank, naming the item or field.
    """
    _require_numpy("load_sharded")
    agree_call(
        LOAD_SHARDED_CALL, optimizer.group, optimizer.collective_timeout
    )  # [Note: Call agreement]
    group = optimizer.group
    params = global_params(optimizer.param_groups)
    error: Exception | None = None
    opened: Opened | None = None
    try:
        opened = _open(Path(path), allow_pickle, allow_missing_commit_record)
        validate_against(opened, params)
    except (FileNotFoundError, ValueError, OSError) as e:
        error = e
    # Every rank decides the same way from shared files, but a rank that cannot see them (no
    # shared filesystem) must not leave the others waiting in DCP's collectives.
    agree_outcome(outcome(error), group, "load_sharded", template=_AS_IS, default=ValueError)
    if opened is None:  # unreachable: no rank reported an error
        raise RuntimeError("load_sharded: internal error, the checkpoint was not opened")
    wanted = set(optimizer.checkpoint_indices())
    req = request(opened, wanted)
    optimizer.load_state_dict(
        _read_verified(opened, req, f"load_sharded({path})", allow_pickle, group)
    )


def load_consolidated(
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    allow_missing_commit_record: bool = False,
) -> dict[str, Any]:
    """Reads a sharded checkpoint offline (one process, no process group) as one plain dict.

    The result loads into the plain torch optimizer class that was sharded. Safe on untrusted
    checkpoints as :func:`load_sharded` (sizes are checked against the checkpoint's own param
    shapes, as there is no model here); every item is checked against its saved checksum.

    Args:
        path: the checkpoint directory.
        allow_pickle: as for :func:`load_sharded`: also load a format-1 checkpoint, UNPICKLING
            its records (runs any code a crafted checkpoint contains; only for checkpoints you
            trust).
        allow_missing_commit_record: as for :func:`load_sharded`: also load a checkpoint
            without a readable commit record (a format-1 or 0.1 checkpoint then loads
            UNVERIFIED).

    Raises:
        FileNotFoundError: ``path`` is not a committed checkpoint.
        ValueError: (``UnsafeCheckpointError`` for what only a damaged or crafted checkpoint
            holds) an item fails its checksum, a record its schema, sizes do not fit, or it
            needs an opt-in above.
    """
    opened = _open(Path(path), allow_pickle, allow_missing_commit_record)
    validate_against(opened, None)
    req = request(opened, None)
    loaded = _read_verified(opened, req, f"load_consolidated({path})", allow_pickle, None)
    return dequantize_state_dict(loaded)  # plain torch: [Note: Compact checkpoint items]
