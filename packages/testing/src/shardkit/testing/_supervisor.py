"""The pytest side of a world's reaper: start the ranks through it, follow them, kill the tree.

See [Note: Process tree of a world] in ``_reaper.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["RankCommand", "RankProcess", "Reaper"]

logger = logging.getLogger("shardkit.testing")

_REAPER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")

_logged_fallbacks: set[str] = set()
_logged_lock = threading.Lock()


def _log_fallback_once(feature: str, detail: str) -> None:
    """Logs a reaper fallback the first time this process hears of it."""
    with _logged_lock:
        if feature in _logged_fallbacks:
            return
        _logged_fallbacks.add(feature)
    logger.warning(
        "shardkit.testing: %s; a world's processes are still killed at teardown, but a rank's "
        "child may survive a rank crash or the death of the pytest process",
        detail,
    )


@dataclass(frozen=True)
class RankCommand:
    """How the reaper starts one rank."""

    argv: list[str]
    """The command line."""

    env: dict[str, str] = field(default_factory=dict)
    """Variables set on top of the reaper's environment."""

    log: str = os.devnull
    """File receiving the rank's stdout and stderr (appended)."""


class RankProcess:
    """One rank as its reaper reports it (the pytest process is not the rank's parent)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pid: int | None = None
        """Process id, once the reaper started the rank."""
        self.returncode: int | None = None
        """Exit code once exited (``-N``: killed by signal N); None while running or unknown."""
        self._exited = threading.Event()

    @property
    def exited(self) -> bool:
        """Whether the rank is known to have exited (or its reaper is gone)."""
        return self._exited.is_set()

    def wait(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for the rank to exit; returns whether it has."""
        return self._exited.wait(max(0.0, timeout))

    def _set_exited(self, code: int | None) -> None:
        if not self._exited.is_set():
            self.returncode = code
            self._exited.set()


class Reaper:
    """A world's reaper process (``_reaper.py``), leading the world's session.

    Args:
        env: the environment of the reaper, inherited by every rank.
        log: file receiving the reaper's own stderr.
    """

    def __init__(self, env: dict[str, str], log: str) -> None:
        with open(log, "wb") as err:
            self._proc = subprocess.Popen(
                # -I -S: no user paths, no site-packages; the reaper needs the stdlib only.
                [sys.executable, "-I", "-S", _REAPER_PATH],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                start_new_session=True,  # See [Note: Process tree of a world]
            )
        self.ranks: dict[int, RankProcess] = {}
        self.errors: list[str] = []
        """Errors the reaper reported (a rank it could not start, processes it could not kill)."""
        self._gone = threading.Event()
        self._killed = False
        self._reader = threading.Thread(
            target=self._read, name=f"shardkit-reaper-{self._proc.pid}", daemon=True
        )

    @property
    def pid(self) -> int:
        """The reaper's pid, also the world's session and process group id."""
        return self._proc.pid

    def start(self, commands: list[RankCommand]) -> dict[int, RankProcess]:
        """Has the reaper start one rank per command; returns the ranks' handles."""
        self.ranks = {rank: RankProcess(rank) for rank in range(len(commands))}
        self._reader.start()
        spec = {"ranks": [{"argv": c.argv, "env": c.env, "log": c.log} for c in commands]}
        stdin = self._stdin()
        try:
            stdin.write(json.dumps(spec).encode() + b"\n")
            stdin.flush()
        except OSError:  # the reaper died at once: the reader marks every rank exited
            pass
        return self.ranks

    def _stdin(self) -> IO[bytes]:
        if self._proc.stdin is None:  # pragma: no cover (always a pipe)
            raise RuntimeError("the reaper's stdin is not a pipe")
        return self._proc.stdin

    def _read(self) -> None:
        stdout = self._proc.stdout
        if stdout is None:  # pragma: no cover (always a pipe)
            return
        try:
            for line in stdout:
                try:
                    message: dict[str, Any] = json.loads(line)
                except ValueError:
                    continue
                self._handle(message)
        finally:
            # The reaper exited: it reaped every rank first, or it was killed and the ranks died
            # with it (PR_SET_PDEATHSIG). Exit codes not reported are unknown.
            for proc in self.ranks.values():
                proc._set_exited(None)  # noqa: SLF001 (same distribution)
            self._gone.set()

    def _handle(self, message: dict[str, Any]) -> None:
        event = message.get("event")
        proc = self.ranks.get(message.get("rank", -1))
        if event == "started" and proc is not None:
            proc.pid = int(message["pid"])
        elif event == "exited" and proc is not None:
            proc._set_exited(message.get("code"))  # noqa: SLF001 (same distribution)
        elif event == "fallback":
            _log_fallback_once(str(message.get("feature")), str(message.get("detail")))
        elif event == "error":
            self.errors.append(str(message.get("detail")))

    def kill(self, timeout: float = 10.0) -> None:
        """Kills the world's whole process tree, then the reaper. Idempotent.

        Closing the reaper's stdin tells it to SIGKILL every descendant; once it has exited, its
        process group is killed too (before the reaper is reaped, so the group id cannot have
        been reused). See [Note: Process tree of a world].
        """
        if self._killed:
            return
        self._killed = True
        with contextlib.suppress(OSError):
            self._stdin().close()
        if self._reader.is_alive():
            self._gone.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5.0)
        self._reader.join(1.0)
        if self._proc.stdout is not None:
            with contextlib.suppress(OSError):
                self._proc.stdout.close()
        for proc in self.ranks.values():
            proc._set_exited(proc.returncode)  # noqa: SLF001 (same distribution)
