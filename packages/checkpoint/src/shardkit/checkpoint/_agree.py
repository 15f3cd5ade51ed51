"""Every rank raises the error of the first rank whose part of a save or load failed.

[Note: Checkpoint agreement]
:func:`shardkit.checkpoint.save` and :func:`~shardkit.checkpoint.load` are collectives, and a
rank must never leave the others waiting in DCP's collectives because it alone failed (its
files are not visible, its state dict does not fit, its disk is full). So each step that one
rank may fail alone ends in one all-gather of every rank's outcome, ``(error type name,
message)`` or ``None``, and every rank raises the first failing rank's error, with its type
(:data:`ERROR_TYPES`, by name), or goes on together. DCP's own steps gather their failures the
same way (``CheckpointException``); :func:`unwrap` turns those into the same typed error.
This is shardkit-checkpoint's one agreement module; it needs nothing but torch (the object
all-gather of ``torch.distributed``, as DCP's planning uses).
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch.distributed as dist
from shardkit.checkpoint._errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ChecksumError,
    UnsafeCheckpointError,
)
from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["ERROR_TYPES", "Outcome", "agree", "checkpoint_error", "gather", "outcome", "unwrap"]

Outcome: TypeAlias = tuple[str, str] | None
"""One rank's outcome: ``(error type name, message)``, or ``None`` when it succeeded."""

ERROR_TYPES: dict[str, type[Exception]] = {
    t.__name__: t
    for t in (
        UnsafeCheckpointError,
        ChecksumError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointSaveError,
        TypeError,
        ValueError,
        RuntimeError,
        FileNotFoundError,
    )
}
"""The types an agreement raises again on every rank, by name; others become ``RuntimeError``."""


def outcome(error: BaseException | None) -> Outcome:
    """What a rank gathers of its local step: its error's type name and message, or ``None``."""
    return None if error is None else (type(error).__name__, str(error))


def gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``value`` (a one-element list without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _raise_first(outcomes: list[Outcome], what: str) -> None:
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not failed:
        return
    rank, (kind, message) = failed[0]
    others = f" (rank(s) {[r for r, _ in failed[1:]]} failed too)" if len(failed) > 1 else ""
    where = f" on rank {rank}{others}" if len(outcomes) > 1 else ""
    cls = ERROR_TYPES.get(kind, RuntimeError)
    prefix = "" if cls is not RuntimeError or kind == "RuntimeError" else f"{kind}: "
    raise cls(f"{what}{where}: {prefix}{message}")


def agree(error: BaseException | None, group: dist.ProcessGroup | None, what: str) -> None:
    """Raises on every rank the first failing rank's error (see [Note: Checkpoint
    agreement]); one all-gather.

    Raises:
        The first failing rank's error type (``RuntimeError`` for a type not in
        :data:`ERROR_TYPES`), its message prefixed with ``what`` and the rank.
    """
    _raise_first(gather(outcome(error), group), what)


def checkpoint_error(error: BaseException) -> BaseException:
    """The error a checkpoint load or save failed with, out of DCP's wrapping.

    ``torch.distributed.checkpoint.load`` / ``save`` raise ``CheckpointException`` holding every
    failing rank's exception; this returns the first failing rank's (by rank) shardkit error
    (``UnsafeCheckpointError``, ``ChecksumError``, ``CheckpointMismatchError``, ...) when it is
    one, else that rank's exception, and ``error`` itself when it is not DCP's wrapper::

        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(path))
        except CheckpointException as e:
            cause = checkpoint_error(e)
            if isinstance(cause, UnsafeCheckpointError):
                ...  # a damaged or crafted checkpoint, refused

    Args:
        error: what ``dcp.load`` / ``dcp.save`` (or anything else) raised.

    Returns:
        The typed error (the very exception object on the rank that raised it; a copy of it
        on the others, as DCP gathers them).
    """
    if not isinstance(error, CheckpointException):
        return error
    failures = error.failures if isinstance(error.failures, dict) else {}
    first: BaseException | None = None
    for rank in sorted(failures):
        inner = failures[rank]
        exc = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(exc, tuple(ERROR_TYPES.values())) and type(exc).__module__.startswith(
            "shardkit."
        ):
            return exc
        if first is None and isinstance(exc, BaseException):
            first = exc
    return error if first is None else first


def unwrap(e: CheckpointException, what: str) -> Exception:
    """The typed error of the first failing rank of DCP's ``CheckpointException`` (which DCP
    raises on every rank with every rank's failure)."""
    failures = e.failures if isinstance(e.failures, dict) else {}
    for rank in sorted(failures):
        inner = failures[rank]
        exc = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(exc, BaseException):
            cls = ERROR_TYPES.get(type(exc).__name__, RuntimeError)
            text = str(exc)[:4000]
            if cls is RuntimeError and type(exc) is not RuntimeError:
                text = f"{type(exc).__name__}: {text}"
            where = f" on rank {rank}" if len(failures) > 1 or rank else ""
            return cls(f"{what}{where}: {text}")
    return RuntimeError(f"{what}: {str(e)[:4000]}")
