"""Opening a checkpoint's files without following a link out of its directory.

[Note: No path leaves the checkpoint]
The directory the user names may itself be a symbolic link (a job's ``ckpt -> /scratch/run7``),
but nothing below it may be: not a version directory, not ``LATEST``, ``.metadata``,
``SHARDKIT_COMMIT`` nor a ``.distcp`` file. A link there would make a load read a file the
checkpoint's writer chose anywhere on the reader's machine (``/proc/self/environ``, another
user's data) and hand it to the decoders, or make a checkpoint "load equal" from bytes that are
not in it. The check is made *at open*, not before it: each open starts from a descriptor of the
named directory and descends one component at a time with ``O_NOFOLLOW`` (``dir_fd=``), so a
link swapped in between a check and the read is refused too. A file must be a regular file,
checked with ``fstat`` on the opened descriptor (``O_NONBLOCK``: a FIFO neither blocks nor is
read). :class:`Location` is the one way shardkit-checkpoint opens a checkpoint's files.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shardkit.checkpoint._errors import UnsafeCheckpointError

__all__ = ["LinkedPathError", "Location", "as_location"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_LINK_ERRORS = (errno.ELOOP, getattr(errno, "EMLINK", errno.ELOOP))


class LinkedPathError(UnsafeCheckpointError):
    """A file or directory below the named checkpoint directory is a symbolic link."""


def _linked(path: Path) -> LinkedPathError:
    return LinkedPathError(
        f"{path} is a symbolic link: a checkpoint's files and version directories must be in "
        f"its directory (only the directory you name may be a link); the checkpoint is damaged "
        f"or crafted"
    )


@dataclass(frozen=True)
class Location:
    """A directory of checkpoint files: ``root`` (as the user named it; may be a link) and the
    directories ``sub`` below it (never links). See [Note: No path leaves the checkpoint]."""

    root: Path
    """The directory the user named."""
    sub: tuple[str, ...] = ()
    """Directory names below ``root`` (a committed version ``v-<token>``), one component each."""

    @property
    def path(self) -> Path:
        """The directory as a path (for messages and for writers)."""
        return self.root.joinpath(*self.sub)

    def __fspath__(self) -> str:
        return str(self.path)

    def child(self, name: str) -> Location:
        """The directory ``name`` below this one."""
        return Location(self.root, (*self.sub, name))

    def dir_fd(self) -> int:
        """A descriptor of this directory (the caller closes it): ``root`` opened as named,
        each of ``sub`` with ``O_NOFOLLOW``.

        Raises:
            UnsafeCheckpointError: a directory of ``sub`` is a link.
        """
        fd = os.open(self.root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        try:
            for i, name in enumerate(self.sub):
                try:
                    nxt = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
                except OSError as e:
                    # O_DIRECTORY | O_NOFOLLOW on a link: ELOOP, or ENOTDIR (it is no directory)
                    if e.errno in _LINK_ERRORS or (
                        e.errno == errno.ENOTDIR
                        and stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                    ):
                        raise _linked(self.root.joinpath(*self.sub[: i + 1])) from None
                    raise
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_fd(self, name: str) -> int:
        """A descriptor of the regular file ``name`` here, opened without following a link.

        Raises:
            FileNotFoundError: the file (or a directory of ``sub``) is absent.
            UnsafeCheckpointError: it, or a directory of ``sub``, is a link; or it is not a
                regular file (a FIFO, a device, a directory).
        """
        if not name or "/" in name or name in (".", ".."):
            raise UnsafeCheckpointError(f"{name!r} is not a file name of the checkpoint")
        dfd = self.dir_fd()
        try:
            try:
                fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dfd)
            except OSError as e:
                if e.errno in _LINK_ERRORS:
                    raise _linked(self.path / name) from None
                raise
        finally:
            os.close(dfd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafeCheckpointError(
                f"{self.path / name} is not a regular file (a FIFO, device or directory would "
                f"block or never end); the checkpoint is damaged or crafted"
            )
        return fd

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """The regular file ``name`` here, opened for reading (see :meth:`open_fd`)."""
        with os.fdopen(self.open_fd(name), "rb") as f:
            yield f

    def read(self, name: str, limit: int | None = None) -> bytes:
        """The bytes of the file ``name`` here (its first ``limit`` bytes when given)."""
        with self.open(name) as f:
            return f.read() if limit is None else f.read(limit)

    def size(self, name: str) -> int:
        """The size of the regular file ``name`` here, or -1 when it is absent or not a regular
        file.

        Raises:
            UnsafeCheckpointError: it, or a directory of ``sub``, is a link.
        """
        try:
            fd = self.open_fd(name)
        except FileNotFoundError:
            return -1
        except LinkedPathError:
            raise
        except UnsafeCheckpointError:  # not a regular file
            return -1
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def is_file(self, name: str) -> bool:
        """Whether ``name`` here is a regular file (a link raises: see :meth:`size`)."""
        return self.size(name) >= 0

    def is_dir(self, name: str) -> bool:
        """Whether ``name`` here is a directory that is not a link.

        Raises:
            UnsafeCheckpointError: it is a link (to anything).
        """
        try:
            os.close(self.child(name).dir_fd())
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True


def as_location(directory: Location | str | os.PathLike[str]) -> Location:
    """``directory`` as a :class:`Location` (a path: the directory itself, nothing below)."""
    return directory if isinstance(directory, Location) else Location(Path(directory))
