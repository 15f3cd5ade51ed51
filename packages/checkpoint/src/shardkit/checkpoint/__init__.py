"""shardkit.checkpoint: safe, atomic, verified ``torch.distributed.checkpoint`` (DCP) checkpoints.

- :class:`SafeFileSystemReader`: pass it to ``torch.distributed.checkpoint.load`` to load a
  checkpoint you did not write without running its code (allow-list metadata reader, checked
  file names and sizes, weights-only decoding, bounded work on hostile structure).
- :func:`save` / :func:`load`: any DCP state dict (a model's and an optimizer's, FSDP2 shards),
  committed atomically behind a ``LATEST`` pointer with the CRC-32 of every stored chunk, loaded
  after every entry is checked against the destination.
- :func:`open_checkpoint`, :func:`inspect`, :func:`verify` and the ``shardkit-checkpoint`` CLI:
  look at a checkpoint, and check every byte of it, without a model.
- :func:`to_record` / :func:`from_record`: small non-tensor state as JSON data, not a pickle.
- :func:`agree_outcome` / :func:`agreed_error` / :func:`outcome` / :func:`register_error_type`:
  the one outcome agreement of shardkit (every rank raises the first failing rank's typed error),
  and :func:`checkpoint_error`, the typed error out of DCP's ``CheckpointException``.

Depends on torch alone (NumPy for saves and loads across ranks, as DCP needs it).
"""

from shardkit.checkpoint.__about__ import __version__
from shardkit.checkpoint._agree import (
    REFUSED,
    Outcome,
    agree_outcome,
    agreed_error,
    checkpoint_error,
    outcome,
    register_error_type,
)
from shardkit.checkpoint._api import Checkpoint, load, open_checkpoint, save
from shardkit.checkpoint._commit import checksum
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ChecksumError,
    UnsafeCheckpointError,
)
from shardkit.checkpoint._reader import SafeFileSystemReader
from shardkit.checkpoint._records import from_record, to_record
from shardkit.checkpoint._verify import VerifyReport, inspect, verify

__all__ = [
    "Checkpoint",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "ChecksumError",
    "SafeFileSystemReader",
    "UnsafeCheckpointError",
    "Outcome",
    "REFUSED",
    "VerifyReport",
    "__version__",
    "agree_outcome",
    "agreed_error",
    "checkpoint_error",
    "checksum",
    "describe",
    "from_record",
    "inspect",
    "load",
    "open_checkpoint",
    "outcome",
    "register_error_type",
    "save",
    "to_record",
    "verify",
]
