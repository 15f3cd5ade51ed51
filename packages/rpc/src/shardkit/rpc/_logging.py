"""The ``shardkit.rpc`` logger and the log-once helper for fallbacks."""

from __future__ import annotations

import logging
import threading

__all__ = ["log_once", "logger"]

logger = logging.getLogger("shardkit.rpc")

# Keys already logged by `log_once` in this process. Guarded by `_logged_lock`.
_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(key: str, level: int, message: str, *args: object) -> None:
    """Log ``message % args`` on ``shardkit.rpc`` the first time this process meets ``key``.

    Every fallback (a slower path taken silently, a value treated conservatively) goes through
    here, so it shows once per process and per cause, not once per step.
    """
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.log(level, message, *args)
