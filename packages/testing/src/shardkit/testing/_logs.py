"""Log records captured inside a rank body, where pytest's ``caplog`` cannot reach.

Rank bodies run in the world's worker processes, not in pytest's, so ``caplog`` (a handler on
pytest's side) sees nothing they log. :func:`captured_logs` does what ``caplog`` does, in the
process that logs: it attaches a list handler to one logger and lowers that logger's level for
the duration of the block.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LogCapture", "captured_logs"]


class LogCapture(logging.Handler):
    """A handler that keeps every record it receives (see :func:`captured_logs`)."""

    def __init__(self, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []
        """Every record received, in order."""

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        """The formatted message of every record, in order."""
        return [r.getMessage() for r in self.records]

    def matching(self, text: str) -> list[str]:
        """The messages that contain ``text``."""
        return [m for m in self.messages() if text in m]


@contextmanager
def captured_logs(name: str, level: int = logging.DEBUG) -> Iterator[LogCapture]:
    """Captures the records of logger ``name`` (and its children) at ``level`` and above.

    Example:
        >>> import logging
        >>> with captured_logs("shardkit.example") as logs:
        ...     logging.getLogger("shardkit.example.sub").info("hello %s", "rank")
        >>> logs.matching("hello")
        ['hello rank']

    Args:
        name: the logger, e.g. ``"shardkit.optim"``.
        level: the lowest level captured; the logger's own level is lowered to it inside the
            block and restored after.

    Raises:
        TypeError: ``name`` is not a str or ``level`` not an int.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a logger name (str), got {type(name).__name__}: {name!r}")
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(
            f"level must be a logging level int (e.g. logging.DEBUG), got "
            f"{type(level).__name__}: {level!r}"
        )
    log = logging.getLogger(name)
    handler, old_level = LogCapture(level), log.level
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
