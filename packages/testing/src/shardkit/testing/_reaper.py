"""The per-world reaper: parent of a world's ranks and killer of the world's whole process tree.

Run by path (``python -I -S .../_reaper.py``), never as ``-m shardkit.testing._reaper``: the
package's ``__init__`` imports torch and pytest, and this process must start in milliseconds and
stay small. Standard library only; it imports nothing from shardkit.

[Note: Process tree of a world]
A world's processes form one tree in one session, and every way the world can end kills the
whole tree (the ranks *and* anything they started):

* The pytest process starts one reaper per world (this module) with ``start_new_session=True``:
  the reaper leads a new session and process group ``S`` (its pid), holding no terminal, so a
  Ctrl-C in the terminal reaches pytest only. The reaper starts the ranks; they and every child
  they start stay in ``S`` unless they call ``setsid``/``setpgid`` themselves.
* The reaper is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a process of the world
  whose parent dies (a rank crashed and left a ``subprocess.Popen`` child behind, or a child that
  left ``S`` with ``start_new_session=True``) is re-parented to the reaper instead of init, so
  every live process of the world is always a descendant of the reaper.
* Each rank gets ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` before ``exec``: if the reaper itself is
  killed, the kernel kills the ranks, whatever they are doing (a rank holding the GIL in a C call
  runs no Python thread, so no watchdog thread could notice anything).
* The reaper kills the tree, by walking ``/proc`` for its live descendants and sending each
  ``SIGKILL`` until none is left, when (1) its stdin reaches EOF: the pytest process closed it
  (teardown after a pass, a failure, a timeout, a ``KeyboardInterrupt``, the end of the session)
  or died (even by ``SIGKILL``, which runs no Python code: the kernel closes the pipe);
  (2) its parent pid changes (pytest died while a process it forked without ``exec`` still holds
  the pipe); (3) it gets ``SIGTERM``/``SIGHUP``/``SIGINT``.
* Once the reaper has exited, pytest sends ``SIGKILL`` to the process group ``S`` before reaping
  the reaper (so ``S`` cannot have been reused), which covers platforms without ``/proc`` or
  without the prctl options; when pytest is gone, the reaper does that itself as its last act.

Fallbacks (no prctl: not Linux; no ``/proc``) are reported to the pytest process, which logs
each once. Without a subreaper, a process that both left ``S`` and lost its parent escapes.

Protocol (one JSON object per line). pytest writes the spec on stdin:
``{"ranks": [{"argv": [...], "env": {...}, "log": path}, ...]}`` and then only closes stdin.
The reaper writes on stdout ``{"event": "started", "rank": r, "pid": p}``,
``{"event": "exited", "rank": r, "code": c}`` (``-N``: killed by signal N, like ``Popen``),
``{"event": "fallback", "feature": name, "detail": text}`` and
``{"event": "error", "detail": text}``, and exits once the tree is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

_POLL_S = 0.5
"""How often the reaper checks that its parent is still the pytest process that started it."""

_KILL_DEADLINE_S = 20.0
"""How long the reaper keeps killing re-appearing descendants before it gives up."""

_stop_reason: str | None = None


def _emit(message: dict[str, Any]) -> bool:
    """Writes one report line to pytest; False if pytest is gone (broken pipe)."""
    data = (json.dumps(message) + "\n").encode()
    try:
        while data:
            written = os.write(1, data)
            data = data[written:]
    except OSError:
        return False
    return True


def _prctl() -> Callable[[int, int], bool] | None:
    """``prctl(option, value)`` returning success, or None where there is no prctl (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int

    def call(option: int, value: int) -> bool:
        return int(fn(option, value, 0, 0, 0)) == 0

    return call


def _live_descendants(root: int) -> list[int] | None:
    """Pids of every live (not zombie) descendant of ``root``; None without ``/proc``."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    children: dict[int, list[int]] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) < 2 or fields[0] in (b"Z", b"X"):
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
    found: list[int] = []
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


class _Reaper:
    def __init__(self) -> None:
        self.parent = os.getppid()
        self.pid = os.getpid()
        self.ranks: dict[int, int] = {}  # pid -> rank, until reported exited
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pytest_alive = True
        self.prctl = _prctl()
        self.pdeathsig = False
        if self.prctl is None:
            self.fallback(
                "prctl",
                "no prctl on this platform: PR_SET_CHILD_SUBREAPER and "
                "PR_SET_PDEATHSIG are unavailable",
            )
        else:
            if not self.prctl(_PR_SET_CHILD_SUBREAPER, 1):
                self.fallback(
                    "subreaper",
                    f"prctl(PR_SET_CHILD_SUBREAPER) failed (errno {ctypes.get_errno()})",
                )
            self.pdeathsig = True

    def report(self, message: dict[str, Any]) -> None:
        if self.pytest_alive and not _emit(message):
            self.pytest_alive = False

    def fallback(self, feature: str, detail: str) -> None:
        self.report({"event": "fallback", "feature": feature, "detail": detail})

    # -- start --------------------------------------------------------------------------------

    def _child_setup(self) -> None:
        """Runs in each rank between fork and exec (this process has no other thread)."""
        if self.pdeathsig and self.prctl is not None:
            self.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != self.pid:  # the reaper died before the prctl took effect
            os._exit(1)

    def spawn(self, spec: dict[str, Any]) -> None:
        for rank, entry in enumerate(spec["ranks"]):
            env = dict(os.environ)
            env.update(entry["env"])
            with open(entry["log"], "ab") as log:
                proc = subprocess.Popen(
                    entry["argv"],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=self._child_setup,
                )
            self.procs.append(proc)  # kept referenced: reaped by _reap, never by Popen
            self.ranks[proc.pid] = rank
            self.report({"event": "started", "rank": rank, "pid": proc.pid})

    # -- watch --------------------------------------------------------------------------------

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            for proc in self.procs:
                if proc.pid == pid:
                    proc.returncode = code  # so Popen never waits for it again
            rank = self.ranks.pop(pid, None)
            if rank is not None:
                self.report({"event": "exited", "rank": rank, "code": code})

    def watch(self, wake: int) -> None:
        """Returns when the tree must be killed. See [Note: Process tree of a world]."""
        while _stop_reason is None:
            try:
                ready, _, _ = select.select([0, wake], [], [], _POLL_S)
            except InterruptedError:  # pragma: no cover (PEP 475 retries)
                ready = []
            if wake in ready:
                with contextlib.suppress(OSError):
                    os.read(wake, 4096)
            self._reap()
            if 0 in ready:
                try:
                    data = os.read(0, 4096)
                except OSError:
                    data = b""
                if not data:
                    return  # pytest closed the pipe or died
            if os.getppid() != self.parent:
                self.pytest_alive = False
                return

    # -- kill ---------------------------------------------------------------------------------

    def kill_tree(self) -> None:
        """SIGKILLs every descendant until none is left, reaping them (ranks reported)."""
        deadline = time.monotonic() + _KILL_DEADLINE_S
        no_proc_reported = False
        while True:
            victims = _live_descendants(self.pid)
            without_proc = victims is None
            if victims is None:
                if not no_proc_reported:
                    no_proc_reported = True
                    self.fallback(
                        "proc",
                        "no /proc: the reaper kills only the ranks; their "
                        "process group is killed after it, but a descendant that "
                        "left the group survives",
                    )
                victims = list(self.ranks)
            if not victims:
                break
            for pid in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
            self._reap()
            if without_proc and not self.ranks:
                break
            if time.monotonic() > deadline:
                self.report(
                    {
                        "event": "error",
                        "detail": f"processes {victims} survived "
                        f"{_KILL_DEADLINE_S:.0f}s of SIGKILL",
                    }
                )
                break
        # Ranks killed above whose exit the kernel has not reported yet.
        end = time.monotonic() + 2.0
        while self.ranks and time.monotonic() < end:
            time.sleep(0.02)
            self._reap()
        self._reap()


def _read_spec() -> dict[str, Any] | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        data += chunk
    spec: dict[str, Any] = json.loads(data)
    return spec


def main() -> int:
    """Start the ranks described on stdin, then kill the whole tree when told or orphaned."""
    global _stop_reason

    def stop(signum: int, frame: object) -> None:
        global _stop_reason
        _stop_reason = signal.Signals(signum).name

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, stop)
    reaper = _Reaper()
    try:
        spec = _read_spec()
        if spec is not None:
            reaper.spawn(spec)
            reaper.watch(wake_r)
    except Exception:
        reaper.report({"event": "error", "detail": traceback.format_exc()})
    finally:
        reaper.kill_tree()
    if not reaper.pytest_alive or os.getppid() != reaper.parent:
        # Nobody will kill the process group after us: do it (this process included).
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
