"""Every exit path of a world kills its whole process tree: ranks, their children, the reaper.

Each case runs an inner pytest session (in a subprocess) whose ranks start two ``sleep 600``
children each: one in the rank's process group, one that leaves it (``start_new_session=True``).
The test then ends the world one way (a crashed rank, a pass followed by the end of the session,
a timeout, a ``KeyboardInterrupt`` of pytest, ``SIGKILL`` of pytest while a rank holds the GIL)
and checks, through ``/proc``, that every recorded process is gone within a generous bound.
See [Note: Process tree of a world] in ``shardkit/testing/_reaper.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="process-tree checks read /proc (Linux only)"
)

_GONE_WITHIN_S = 30.0
"""Generous bound for "gone within seconds" on a loaded 2-core machine."""

_INNER = '''
import ctypes, os, subprocess, time
import torch.distributed as dist
from shardkit.testing import world

PIDS = {pids!r}


def _record(tag, pid):
    tmp = os.path.join(PIDS, f".{{tag}}")
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.rename(tmp, os.path.join(PIDS, tag))


def _spawn_children(case):
    """Two children per rank: one in the rank's process group, one that leaves it."""
    rank = dist.get_rank()
    plain = subprocess.Popen(["sleep", "600"])
    escaped = subprocess.Popen(["sleep", "600"], start_new_session=True)
    _record(f"{{case}}-child-{{rank}}", plain.pid)
    _record(f"{{case}}-escaped-{{rank}}", escaped.pid)
    _record(f"{{case}}-parent-{{rank}}", os.getppid())  # the world's reaper
    _record(f"{{case}}-rank-{{rank}}", os.getpid())


def _hold_gil(seconds):
    """Sleeps in a C call that keeps the GIL (ctypes.PyDLL): no Python thread of this process
    can run meanwhile, the watchdog thread included. A signal (the SIGUSR1 asking for stacks)
    cuts libc's sleep() short: sleep again."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ctypes.PyDLL(None).sleep(int(end - time.monotonic()) + 1)


def _assert_gone(case):
    """Every process recorded for ``case`` has exited (zombies count as exited)."""
    pids = {{n: int(open(os.path.join(PIDS, n)).read()) for n in os.listdir(PIDS)
            if n.startswith(case + "-") and "parent" not in n}}
    assert pids, "nothing recorded"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = {{n: p for n, p in pids.items() if _alive(p)}}
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes survive their failed test: {{alive}}")


def _alive(pid):
    try:
        with open(f"/proc/{{pid}}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
'''


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _recorded(pids: str, case: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in os.listdir(pids):
        if name.startswith(case + "-"):
            with open(os.path.join(pids, name)) as f:
                out[name] = int(f.read())
    return out


def _wait_for(pids: str, case: str, count: int, proc: subprocess.Popen[bytes] | None) -> None:
    """Waits until ``count`` processes are recorded for ``case`` (ranks started, children too)."""
    deadline = time.monotonic() + 240
    while len(_recorded(pids, case)) < count:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"inner pytest exited early with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"only {_recorded(pids, case)} recorded after 240s")
        time.sleep(0.2)


def _survivors(recorded: dict[str, int]) -> dict[str, int]:
    """The recorded processes still alive after waiting up to ``_GONE_WITHIN_S``."""
    deadline = time.monotonic() + _GONE_WITHIN_S
    while True:
        alive = {name: pid for name, pid in recorded.items() if _alive(pid)}
        if not alive or time.monotonic() > deadline:
            return alive


def _cleanup(recorded: dict[str, int]) -> None:
    """Kills what a failing run left behind (only processes this test recorded)."""
    for pid in recorded.values():
        if _alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _setup(pytester: pytest.Pytester, tmp_path: os.PathLike[str], body: str) -> str:
    pids = os.path.join(os.fspath(tmp_path), "pids")
    os.mkdir(pids)
    pytester.makepyfile(_INNER.format(pids=pids) + body)
    return pids


def test_crashed_rank_children_are_killed(
    pytester: pytest.Pytester, tmp_path: os.PathLike[str]
) -> None:
    """A rank that started children then crashed: the children are gone once the test failed
    (checked by the next test of the same session), and the world is replaced."""
    pids = _setup(
        pytester,
        tmp_path,
        """
@world(2, timeout=90)
def test_crash():
    _spawn_children("crash")
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(7)  # a crash: no exception, no cleanup
    dist.barrier()


def test_crashed_world_is_gone():
    _assert_gone("crash")
""",
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    recorded = _recorded(pids, "crash")
    try:
        result.assert_outcomes(failed=1, passed=1)
        assert "rank 1 of 2 died (exit code 7)" in result.stdout.str()
        assert not _survivors(recorded)
    finally:
        _cleanup(recorded)


def test_normal_teardown_kills_children(
    pytester: pytest.Pytester, tmp_path: os.PathLike[str]
) -> None:
    """A passing test whose ranks leave children running: the end of the session (ranks exit
    cleanly on Shutdown) still kills them, and the reaper."""
    pids = _setup(
        pytester,
        tmp_path,
        """
@world(2)
def test_leaves_children():
    _spawn_children("pass")
""",
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    recorded = _recorded(pids, "pass")
    try:
        result.assert_outcomes(passed=1)
        assert len(recorded) == 8
        assert not _survivors(recorded)
    finally:
        _cleanup(recorded)


def test_timeout_kills_the_tree_even_with_the_gil_held(
    pytester: pytest.Pytester, tmp_path: os.PathLike[str]
) -> None:
    """A rank holding the GIL past the test's timeout: its stack is still reported, and it,
    its peer and every child are gone once the test failed."""
    pids = _setup(
        pytester,
        tmp_path,
        """
@world(2, timeout=5)
def test_hangs():
    _spawn_children("hang")
    dist.barrier()
    if dist.get_rank() == 1:
        _hold_gil(1000)
    dist.barrier()


def test_timed_out_world_is_gone():
    _assert_gone("hang")
""",
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    recorded = _recorded(pids, "hang")
    try:
        result.assert_outcomes(failed=1, passed=1)
        out = result.stdout.str()
        assert "timed out after 5s" in out
        assert "_hold_gil" in out  # the GIL holder's stack (faulthandler needs no GIL)
        assert not _survivors(recorded)
    finally:
        _cleanup(recorded)


def _inner_pytest(pytester: pytest.Pytester, log: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return pytester.popen(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_keyboard_interrupt_kills_the_tree(
    pytester: pytest.Pytester, tmp_path: os.PathLike[str]
) -> None:
    """Ctrl-C (SIGINT to pytest) while ranks run a test body: pytest exits promptly and the
    whole tree is gone."""
    pids = _setup(
        pytester,
        tmp_path,
        """
@world(2, timeout=300)
def test_interrupted():
    _spawn_children("intr")
    time.sleep(600)
""",
    )
    log = os.path.join(os.fspath(tmp_path), "inner.log")
    proc = _inner_pytest(pytester, log)
    recorded: dict[str, int] = {}
    try:
        _wait_for(pids, "intr", 8, proc)
        recorded = _recorded(pids, "intr")
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        with open(log, errors="replace") as f:
            assert "KeyboardInterrupt" in f.read()
        assert not _survivors(recorded)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _cleanup(recorded or _recorded(pids, "intr"))


def test_pytest_killed_while_a_rank_holds_the_gil(
    pytester: pytest.Pytester, tmp_path: os.PathLike[str]
) -> None:
    """``SIGKILL`` of pytest (no Python code runs in it) while rank 0 holds the GIL in a C call
    and rank 1 waits in a collective: the ranks, their children (in and out of their process
    group) and the reaper are gone within seconds."""
    pids = _setup(
        pytester,
        tmp_path,
        """
@world(2, timeout=300)
def test_holds_gil():
    _spawn_children("gil")
    dist.barrier()
    if dist.get_rank() == 0:
        _record("gil-holding-0", os.getpid())
        _hold_gil(600)
    dist.barrier()
""",
    )
    log = os.path.join(os.fspath(tmp_path), "inner.log")
    proc = _inner_pytest(pytester, log)
    recorded: dict[str, int] = {}
    try:
        _wait_for(pids, "gil", 9, proc)  # 4 records per rank, plus "holding"
        recorded = _recorded(pids, "gil")
        time.sleep(0.5)  # rank 0 is inside the C call
        proc.kill()
        proc.wait()
        survivors = _survivors(recorded)
        assert not survivors, f"survived the death of pytest: {survivors}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _cleanup(recorded or _recorded(pids, "gil"))


def test_reaper_fallbacks_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    from shardkit.testing import _supervisor

    caplog.set_level(logging.WARNING, logger="shardkit.testing")
    _supervisor._logged_fallbacks.discard("test-feature")
    try:
        for _ in range(3):
            _supervisor._log_fallback_once("test-feature", "prctl is missing here")
        records = [r for r in caplog.records if "prctl is missing here" in r.getMessage()]
        assert len(records) == 1
        assert records[0].name == "shardkit.testing"
    finally:
        _supervisor._logged_fallbacks.discard("test-feature")
