"""Every rank raises the error of the first rank whose part of a save or load failed.

[Note: Checkpoint agreement]
:func:`shardkit.checkpoint.save` and :func:`~shardkit.checkpoint.load` are collectives, and a
rank must never leave the others waiting in DCP's collectives because it alone failed (its
files are not visible, its state dict does not fit, its disk is full). So each step that one
rank may fail alone ends in one all-gather of every rank's outcome, ``(error type name,
message)`` or ``None``, and every rank raises the first failing rank's error, with its type
(:data:`ERROR_TYPES`, by name), or goes on together. DCP's own steps gather their failures the
same way (``CheckpointException``); :func:`unwrap` turns those into the same typed error.
This is shardkit's one outcome agreement (see [Note: One outcome agreement]); it needs nothing
but torch (the object all-gather of ``torch.distributed``, as DCP's planning uses, unless the
caller passes its own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch.distributed as dist
from shardkit.checkpoint._errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ChecksumError,
    UnsafeCheckpointError,
)
from shardkit.checkpoint._fs import LinkedPathError
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "ERROR_TYPES",
    "REFUSED",
    "Outcome",
    "agree",
    "agree_outcome",
    "agreed_error",
    "checkpoint_error",
    "gather",
    "outcome",
    "register_error_type",
    "unwrap",
]

Outcome: TypeAlias = tuple[str, str] | None
"""One rank's outcome of a local check: ``(error type name, message)``, or ``None`` when it
passed (see :func:`outcome`)."""

ERROR_TYPES: dict[str, type[Exception]] = {
    t.__name__: t
    for t in (
        UnsafeCheckpointError,
        ChecksumError,
        LinkedPathError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointSaveError,
        TypeError,
        ValueError,
        RuntimeError,
        FileNotFoundError,
    )
}
"""The types an agreement raises again on every rank, by name (a rank gathers only names and
messages): these and those of :func:`register_error_type`; others become the caller's
``default``."""

REFUSED = (
    "{what} failed on rank {rank} of {world}{also}, so it is refused on every rank: "
    "{kind}: {message}"
)
"""The message of :func:`agreed_error` and :func:`agree_outcome` by default."""

_CHECKPOINT = "{what}{where}: {prefix}{message}"
"""The message of this package's own agreements: the failing rank's message, its type's name
in front when that type is not raised again."""


def register_error_type(cls: type[Exception]) -> type[Exception]:
    """Lets agreements raise ``cls`` again on every rank when a rank fails with it (at import
    time, on every rank); returns ``cls``. ``cls(message)`` must build one.

    Raises:
        ValueError: another type of the same name is registered.
    """
    if ERROR_TYPES.setdefault(cls.__name__, cls) is not cls:
        raise ValueError(
            f"error type {cls.__module__}.{cls.__qualname__} has the name of the registered "
            f"{ERROR_TYPES[cls.__name__]!r}: agreements raise errors by name; rename one"
        )
    return cls


def outcome(error: BaseException | None) -> Outcome:
    """What an agreement gathers of ``error``: its type's name and its message (``None``: none)."""
    return None if error is None else (type(error).__name__, str(error))


def gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``value`` (a one-element list without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agreed_error(
    outcomes: Sequence[Outcome],
    what: str,
    *,
    template: str = REFUSED,
    default: type[Exception] = RuntimeError,
) -> Exception | None:
    """The error every rank raises for every rank's outcome of a local check (no collective).

    Every rank that passes the same ``outcomes`` (e.g. from one all-gather, alone or with data)
    gets the same error: the first failing rank's error type, by name (:data:`ERROR_TYPES`;
    ``default`` for any other), and its message through ``template``.

    Args:
        outcomes: every rank's :data:`Outcome`, in rank order.
        what: the operation, for the message.
        template: the message, a ``str.format`` template over ``what``, ``rank`` (the first
            failing rank), ``world`` (``len(outcomes)``), ``also`` (``" (rank(s) [..] failed
            too)"`` or ``""``), ``where`` (``" on rank R"`` plus ``also`` with several ranks,
            else ``""``), ``kind`` (its error type's name), ``prefix`` (``"KIND: "`` when that
            type is raised as ``default``, else ``""``) and ``message`` (its message).
        default: the type raised for an error type not in :data:`ERROR_TYPES`.

    Returns:
        The error to raise, or ``None`` when no rank failed.
    """
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not failed:
        return None
    rank, (kind, message) = failed[0]
    also = f" (rank(s) {[r for r, _ in failed[1:]]} failed too)" if len(failed) > 1 else ""
    cls = ERROR_TYPES.get(kind, default)
    text = template.format(
        what=what,
        rank=rank,
        world=len(outcomes),
        also=also,
        where=f" on rank {rank}{also}" if len(outcomes) > 1 else "",
        kind=kind,
        prefix="" if kind in ERROR_TYPES else f"{kind}: ",
        message=message,
    )
    return cls(text)


# [Note: One outcome agreement]
# A collective that one rank may fail alone (its files are not visible, its state dict does not
# fit, its arguments are bad) ends in one all-gather of every rank's :data:`Outcome`, and every
# rank raises the first failing rank's error with its type (:func:`agree_outcome`, decided by
# :func:`agreed_error`), or goes on together. This is the one implementation: shardkit-optim's
# agreements (and through it shardkit-ddp's and shardkit-overlap's) use it with their own
# message templates and NumPy-free object gather.
def agree_outcome(
    error: BaseException | Outcome,
    group: dist.ProcessGroup | None,
    what: str,
    *,
    template: str = REFUSED,
    default: type[Exception] = RuntimeError,
    gather_objects: Callable[[Any, dist.ProcessGroup | None], list[Any]] | None = None,
) -> None:
    """Raises on every rank the error of the first rank whose local check failed (if any).

    One all-gather of every rank's :data:`Outcome`, decided by :func:`agreed_error`. See
    [Note: One outcome agreement].

    Args:
        error: this rank's error (the cause of what this rank raises), or its :func:`outcome`
            (nothing chained), or ``None``.
        group: the process group (every rank of it calls this, failed or not); ``None``: the
            default group, or this process alone without one.
        what: the operation, for the message.
        template: the message (see :func:`agreed_error`).
        default: the type raised for an error type :data:`ERROR_TYPES` does not list.
        gather_objects: the object all-gather (default: ``torch.distributed.all_gather_object``).

    Raises:
        Exception: on every rank, of the first failing rank's error type (``default`` for a
            type :data:`ERROR_TYPES` does not list).
    """
    mine = outcome(error) if isinstance(error, BaseException) else error
    gathered = (gather_objects or gather)(mine, group)
    failure = agreed_error(gathered, what, template=template, default=default)
    if failure is not None:
        raise failure from (error if isinstance(error, BaseException) else None)


def agree(error: BaseException | None, group: dist.ProcessGroup | None, what: str) -> None:
    """This package's agreement (see [Note: Checkpoint agreement]): the failing rank's message
    as it is, after ``what`` and the rank."""
    agree_outcome(error, group, what, template=_CHECKPOINT)


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
