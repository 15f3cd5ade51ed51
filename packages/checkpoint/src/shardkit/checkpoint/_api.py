"""Atomic, verified save and load of any DCP state dict, and the opened checkpoint.

``save`` = DCP's save into a staging directory + the CRC-32 of every stored chunk + the commit
(see [Note: Atomic commit], [Note: Checkpoint checksums]); ``load`` = the committed version,
read safely and checked against the destination, then DCP's load through
``SafeFileSystemReader`` (see [Note: Safe DCP reading], [Note: Load checks]). Both are
collectives that raise the same typed error on every rank (see [Note: Checkpoint agreement]).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shardkit.checkpoint._commit as _commit
import torch.distributed as dist
from shardkit.checkpoint._agree import agree, gather, unwrap
from shardkit.checkpoint._checks import CheckedLoadPlanner
from shardkit.checkpoint._commit import (
    LAYOUT,
    Staging,
    StorageKey,
    crc32_range,
    read_commit_record,
    resolve_location,
    storage_checksums,
)
from shardkit.checkpoint._errors import CheckpointSaveError, UnsafeCheckpointError
from shardkit.checkpoint._fs import Location
from shardkit.checkpoint._metadata import check_storage, read_safe_metadata
from shardkit.checkpoint._reader import SafeFileSystemReader, check_checksum_keys
from shardkit.checkpoint._records import dumps_json
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = ["Checkpoint", "load", "open_checkpoint", "save"]

logger = logging.getLogger("shardkit.checkpoint")

_TOKEN = re.compile(r"^[0-9a-f]{32}$")
_RESERVED = ("layout", "storage_checksums")


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint, opened safely (:func:`open_checkpoint`); nothing read from its
    payloads yet."""

    path: Path
    """The checkpoint directory."""
    version: Path
    """The committed version: the directory holding DCP's files."""
    metadata: Metadata
    """DCP's metadata, read through the allow-list and checked (see [Note: Safe DCP reading])."""
    record: dict[str, Any] | None
    """The commit record (its ``layout`` fields checked; the saver's own fields, e.g. the
    ``record=`` of :func:`save`, are untrusted data), or ``None`` when it was missing and
    ``allow_missing_commit_record=True``."""

    @property
    def location(self) -> Location:
        """The committed version as a :class:`~shardkit.checkpoint._fs.Location` below
        ``path`` (see [Note: No path leaves the checkpoint])."""
        if self.version == self.path:
            return Location(self.path)
        return Location(self.path, (self.version.name,))

    @property
    def storage_checksums(self) -> dict[StorageKey, int] | None:
        """CRC-32 of every stored chunk by ``(item, chunk offsets)``; ``None`` without a record
        of layout ``shardkit.checkpoint/1`` (shardkit-optim 0.3 and earlier wrote item
        checksums instead, which shardkit-optim checks)."""
        return storage_checksums(self.record)

    def reader(self, *, allow_pickle: bool = False) -> SafeFileSystemReader:
        """A :class:`SafeFileSystemReader` of the committed version, checking its CRC-32s."""
        return SafeFileSystemReader(
            self.location,
            allow_pickle=allow_pickle,
            checksums=self.storage_checksums,
            allow_missing_commit_record=self.storage_checksums is None,
        )


def open_checkpoint(
    path: str | os.PathLike[str], *, allow_missing_commit_record: bool = False
) -> Checkpoint:
    """Opens the committed checkpoint at ``path`` safely: no payload is read.

    Resolves ``LATEST``, reads the commit record and DCP's metadata (allow-list, field checks)
    and checks that every item is backed by its bytes on disk and, when the record has them,
    that every stored chunk has a CRC-32 (see [Note: Safe DCP reading]). Local (no collective).

    Args:
        path: a directory written by :func:`save` (or a shardkit-optim sharded checkpoint).
        allow_missing_commit_record: open a version whose commit record is missing, empty or
            unreadable (``record`` is then ``None``; nothing can be verified against it).

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        UnsafeCheckpointError: the record or the metadata is damaged or crafted, or sizes do
            not fit the files (``ChecksumError``: the chunks and the CRC-32s do not match).
    """
    root = Path(path)
    version = resolve_location(root, require_marker=not allow_missing_commit_record)
    metadata = read_safe_metadata(version)
    record: dict[str, Any] | None
    try:
        record = read_commit_record(version)
    except UnsafeCheckpointError as e:
        if not allow_missing_commit_record:
            raise
        logger.warning(
            "opening %s without its commit record (allow_missing_commit_record=True): %s",
            root,
            str(e).split(";")[0],
        )
        record = None
    check_storage(metadata, version)
    sums = storage_checksums(record)
    if sums is not None:
        check_checksum_keys(metadata, sums, str(version.path))
    return Checkpoint(root, version.path, metadata, record)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _require_numpy(what: str) -> None:
    """DCP plans a distributed save or load with object collectives, which need NumPy (torch
    itself does not depend on it): fail early and clearly instead of deep inside DCP."""
    if importlib.util.find_spec("numpy") is None:
        raise RuntimeError(
            f"{what} across ranks uses torch.distributed.checkpoint, whose planning needs "
            f"NumPy, which is not installed: `pip install numpy` (or `pip install "
            f"'shardkit-checkpoint[distributed]'`). One process (no process group) needs none."
        )


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it assumes a single process without a process group: the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to (save|load) in a single"
        )
        yield


class _ChecksummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter``, then the CRC-32 of every chunk it wrote, read back from the
    files (see [Note: Checkpoint checksums])."""

    checksums: list[list[Any]]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        root = Path(self.path)
        self.checksums = []
        for r in results:
            info = r.storage_data
            offsets = None if r.index.offset is None else [int(d) for d in r.index.offset]
            crc = crc32_range(root / info.relative_path, info.offset, info.length)
            self.checksums.append([r.index.fqn, offsets, crc])
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


def _failure(e: BaseException, rank: int) -> str:
    """``rank r: Type: message`` of a rank's failure (of the first failing rank for DCP's
    ``CheckpointException``, which every rank raises alike)."""
    failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
    if isinstance(failures, dict) and failures:
        first = min(failures)
        inner = failures[first][0] if isinstance(failures[first], tuple) else failures[first]
        if isinstance(inner, BaseException):
            return f"rank {first}: {type(inner).__name__}: {str(inner)[:2000]}"
    return f"rank {rank}: {type(e).__name__}: {str(e)[:2000]}"


def _decide(failures: list[str | None], what: str, staging: Staging | None) -> None:
    """Raises the first failure on every rank (after the coordinator removed its staging)."""
    first = next((f for f in failures if f is not None), None)
    if first is None:
        return
    if staging is not None:
        staging.abort()
    raise CheckpointSaveError(f"{what} failed, nothing was committed: {first}", detail=first)


def _check_record(record: Mapping[str, Any] | None, token: str | None) -> dict[str, Any]:
    if token is not None and (type(token) is not str or not _TOKEN.match(token)):
        raise ValueError(f"token must be 32 lowercase hex digits (uuid.uuid4().hex), got {token!r}")
    out = dict(record or {})
    bad = [k for k in out if not isinstance(k, str) or k in _RESERVED]
    if bad:
        raise ValueError(
            f"record keys must be strs other than {list(_RESERVED)} (written by save), got {bad!r}"
        )
    try:
        dumps_json(out)
    except (TypeError, ValueError) as e:
        raise TypeError(f"record must be JSON-serializable (it is written as JSON): {e}") from None
    return out


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    record: Mapping[str, Any] | None = None,
    token: str | None = None,
) -> Path:
    """Saves a DCP state dict atomically, with the CRC-32 of every stored chunk. Collective.

    Any state dict ``torch.distributed.checkpoint.save`` takes (a model's and an optimizer's
    state, FSDP2 ``DTensor`` shards, non-tensor values). The new checkpoint replaces the one at
    ``path`` atomically: a crash at any instant leaves the old or the new one loadable there
    (see [Note: Atomic commit]). Every rank writes its own chunks, as with DCP.

    Args:
        state_dict: this rank's state dict (every rank of the group calls ``save``).
        path: the checkpoint directory. All ranks must see the same filesystem path.
        process_group: the group saving (default: the default group; none without one).
        record: extra fields for the commit record (JSON-serializable; read back as
            ``Checkpoint.record``, e.g. a step number). Rank 0's is written.
        token: the save's id, 32 hex digits (default: a new uuid4); rank 0's is used.

    Returns:
        The committed version directory (``path/v-<token>``).

    Raises:
        CheckpointSaveError: the save failed on some rank (raised on every rank, naming it);
            nothing was committed and the staging directory is removed.
        ValueError, TypeError: ``record`` or ``token`` are malformed (before anything is
            written).
    """
    final = Path(path)
    what = f"shardkit.checkpoint.save({final})"
    distributed = _distributed()
    if distributed:
        _require_numpy("shardkit.checkpoint.save")
    group = process_group if distributed else None
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    extra = _check_record(record, token)
    coordinator = rank == 0
    # Rank 0 names the save and decides where it stages; every rank writes there.
    staging = Staging(final, token or uuid.uuid4().hex) if coordinator else None
    plan = gather(None if staging is None else (staging.token, str(staging.stage)), group)[0]
    failure: str | None = None
    if staging is not None:
        try:
            staging.prepare()
        except OSError as e:
            failure = f"preparing {staging.stage} failed: {type(e).__name__}: {e}"
    _decide(gather(failure, group), what, staging)
    writer = _ChecksummingWriter(plan[1])
    writer.checksums = []
    try:
        with _one_process():
            _dcp_save(
                state_dict, storage_writer=writer, process_group=group, no_dist=not distributed
            )
        _commit.crash_point("written")  # through the module: tests replace it
    except (Exception, CheckpointException) as e:  # every rank must reach the gather below
        failure = _failure(e, rank)
    parts = gather((failure, writer.checksums), group)
    _decide([f for f, _ in parts], what, staging)
    if staging is not None:
        sums = sorted((s for _, part in parts for s in part), key=lambda s: (s[0], s[1] or []))
        committed = {**extra, "layout": LAYOUT, "token": plan[0], "world_size": world}
        committed["storage_checksums"] = sums
        try:
            staging.commit(committed)
        except (OSError, ValueError) as e:
            failure = f"committing on rank 0 failed: {type(e).__name__}: {e}"
            staging.abort()
    _decide(gather(failure if coordinator else None, group), what, None)
    return final / f"v-{plan[0]}"


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    allow_missing_commit_record: bool = False,
    allow_partial_load: bool = False,
) -> Checkpoint:
    """Loads a checkpoint written by :func:`save` into ``state_dict``, in place, like
    ``torch.distributed.checkpoint.load``, safely and verified. Collective.

    Safe on untrusted checkpoints (see ``docs/security.md``): nothing is unpickled outside an
    allow-list, every entry of ``state_dict`` is checked against the checkpoint before anything
    is read or allocated (keys, shapes, dtypes, tensor or not: [Note: Load checks]), every
    stored chunk read is checked against its CRC-32 before ``torch.load`` sees it, and reading
    the metadata and records costs time and memory linear in their size. Resharding works as
    with DCP (FSDP2 ``DTensor`` shards, another world size).

    Args:
        state_dict: the destination (tensors are loaded into in place; non-tensor values are
            replaced; a ``None`` where the checkpoint holds a tensor becomes that tensor, e.g. a
            :func:`to_record` whose length you do not know), the same keys on every rank.
        path: the checkpoint directory.
        process_group: the group loading (default: the default group; none without one).
        allow_missing_commit_record: load a checkpoint whose commit record is missing, damaged
            or without CRC-32s (shardkit-optim 0.3 and earlier): nothing is then verified
            against checksums (logged).
        allow_partial_load: keys of ``state_dict`` missing from the checkpoint keep their value
            (DCP's ``allow_partial_load``).

    Returns:
        The opened checkpoint (its ``record`` holds the ``record=`` fields of the save).

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint (on every rank: the
            first failing rank's error, naming it, as for the others).
        CheckpointMismatchError: the checkpoint does not fit ``state_dict``.
        UnsafeCheckpointError: the checkpoint is damaged or crafted (``ChecksumError``: stored
            bytes fail their CRC-32).
    """
    what = f"shardkit.checkpoint.load({path})"
    distributed = _distributed()
    if distributed:
        _require_numpy("shardkit.checkpoint.load")
    group = process_group if distributed else None
    opened: Checkpoint | None = None
    error: Exception | None = None
    try:
        opened = open_checkpoint(path, allow_missing_commit_record=allow_missing_commit_record)
        if opened.storage_checksums is None and not allow_missing_commit_record:
            raise UnsafeCheckpointError(
                f"{opened.version}: the commit record holds no CRC-32s of stored chunks (a "
                f"checkpoint of shardkit-optim 0.3 or earlier: load it with "
                f"shardkit.optim.load_sharded, or pass allow_missing_commit_record=True to load "
                f"it unverified)"
            )
    except (FileNotFoundError, ValueError, OSError) as e:
        error = e
    # every rank decides from the same files, but a rank that cannot see them must not leave
    # the others waiting in DCP's collectives: see [Note: Checkpoint agreement]
    agree(error, group, what)
    if opened is None:  # unreachable: every rank agreed there was no error
        raise RuntimeError(f"{what}: internal error, the checkpoint was not opened")
    if opened.storage_checksums is None:
        logger.warning("loading %s without CRC-32 verification", opened.version)
    planner = CheckedLoadPlanner(allow_partial_load=allow_partial_load)
    try:
        with _one_process():
            _dcp_load(
                state_dict,
                storage_reader=opened.reader(),
                planner=planner,
                process_group=group,
                no_dist=not distributed,
            )
    except CheckpointException as e:  # DCP raises it on every rank, with every rank's failure
        raise unwrap(e, what) from None
    return opened
