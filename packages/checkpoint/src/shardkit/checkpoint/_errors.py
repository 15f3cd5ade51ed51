"""The errors of shardkit.checkpoint: one type per kind of failure, each a built-in type's subclass.

Every error takes one message argument (so it pickles, and an agreement between ranks can raise it
again on every rank by type name: see ``_agree.py``). Messages say what was expected, what was
found and what to do; anything they quote from a checkpoint goes through
:func:`shardkit.checkpoint.describe` (see [Note: Bounded work on untrusted input]).
"""

from __future__ import annotations

__all__ = [
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "ChecksumError",
    "UnsafeCheckpointError",
]


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something a safe load refuses (code, a malformed record, sizes that
    do not fit its files or its destination, structure beyond the work bounds): it was damaged
    or crafted."""


class ChecksumError(UnsafeCheckpointError):
    """Stored bytes do not match the CRC-32 saved for them: a file was modified or corrupted
    after the save (or files of two saves were mixed)."""


class CheckpointMismatchError(ValueError):
    """A sound checkpoint that does not fit the state dict it is loaded into: a key is missing,
    or an entry has another shape, dtype or kind (tensor / non-tensor) than the destination's."""


class CheckpointNotFoundError(FileNotFoundError):
    """The path holds no committed checkpoint (a save to it never completed, or it was not
    written by a shardkit save)."""


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; nothing was committed (the previous checkpoint at the path,
    if any, is unchanged) and the staging directory was removed.

    Args:
        message: the whole message.
        detail: the failing rank and its cause (``"rank 1: OSError: disk full"``), for callers
            that name the operation themselves; defaults to ``message``.
    """

    def __init__(self, message: str, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = message if detail is None else detail
