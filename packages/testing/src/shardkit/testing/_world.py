"""Worlds of rank processes, kept alive between tests and torn down on failure.

[Note: World lifecycle]
A world is ``world_size`` processes started with ``python -m shardkit.testing._worker`` by the
world's reaper, in one session of their own (see [Note: Process tree of a world] in
``_reaper.py``), each connected back to the pytest process over an authenticated local socket.
Rendezvous uses a ``FileStore`` in a fresh temporary directory owned by the world, so concurrent
tests and concurrent pytest sessions never collide on a port. A world serves tests one at a time; after a test in which every rank passed and the
default group is still initialised, it is kept for the next test with the same spec. Any failure,
timeout or dead rank discards it: its whole process tree is killed (ranks and anything they
started) and the next test starts a fresh world. So does an exception in the pytest process while
it waits for the ranks (``KeyboardInterrupt``), the end of the session, and the death of the
pytest process itself (the reaper notices).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait

from shardkit.testing._config import WorldSpec
from shardkit.testing._protocol import JobResult, Ready, RunJob, Shutdown
from shardkit.testing._supervisor import RankCommand, RankProcess, Reaper

__all__ = ["JobReport", "World", "WorldPool", "WorldStartError", "pool"]

_STACK_GRACE_S = 1.5
"""How long ranks get to write their faulthandler stacks before they are killed."""

_FAILURE_GRACE_S = 3.0
"""After one rank fails, how long the others get to finish (or fail) on their own."""

_MIN_LIMIT_S = 0.5
"""Smallest limit a body gets when a deadline leaves less (it then times out at once)."""

_LOG_TAIL_CHARS = 6000
"""How much of each rank's output a failure report shows."""


class WorldStartError(RuntimeError):
    """A world's ranks could not be started or could not initialise their process group."""


@dataclass
class JobReport:
    """What happened to one test on one world."""

    results: dict[int, JobResult] = field(default_factory=dict)
    """Per rank: the result the rank sent."""

    died: dict[int, int | None] = field(default_factory=dict)
    """Per rank that died mid-test: its exit code (None if unknown)."""

    still_running: tuple[int, ...] = ()
    """Ranks that had not answered when the report was closed (timeout, or peers of a failure)."""

    timed_out: bool = False
    """True when the test's deadline passed with ranks still running and no failure."""

    elapsed_s: float = 0.0
    """Wall time of the test body on the slowest rank that answered."""

    logs: dict[int, str] = field(default_factory=dict)
    """Per rank: output written during the test (tail), stacks included after a timeout."""

    timeout_s: float = 0.0
    """The limit the body ran under."""

    cut_short: bool = False
    """True when that limit was cut to end before pytest-timeout's deadline."""

    @property
    def failed(self) -> dict[int, str]:
        """Ranks that raised, with their tracebacks."""
        return {r: res.detail for r, res in sorted(self.results.items()) if res.outcome == "failed"}

    @property
    def skipped(self) -> dict[int, str]:
        """Ranks that called ``pytest.skip``, with the reason."""
        return {r: res.detail for r, res in sorted(self.results.items()) if res.outcome == "skipped"}

    @property
    def ok(self) -> bool:
        """Every rank answered and none failed or died."""
        return not (self.failed or self.died or self.still_running or self.timed_out)


class World:
    """``world_size`` rank processes with an initialised default process group."""

    def __init__(self, spec: WorldSpec, startup_timeout: float) -> None:
        self.spec = spec
        self._dir = tempfile.mkdtemp(prefix=f"shardkit-world{spec.world_size}-")
        self._reaper: Reaper | None = None
        self._procs: dict[int, RankProcess] = {}
        self._conns: dict[int, Connection] = {}
        self._log_paths = {r: os.path.join(self._dir, f"rank{r}.log") for r in range(spec.world_size)}
        self._next_job = 0
        self.alive = False
        try:
            self._start(startup_timeout)
        except BaseException:
            self.kill()
            raise
        self.alive = True

    # -- start ------------------------------------------------------------------------------

    def _start(self, startup_timeout: float) -> None:
        authkey = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = listener.address
        env = dict(os.environ)
        env["SHARDKIT_TESTING_AUTHKEY"] = authkey.hex()
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        store = os.path.join(self._dir, "store")
        # See [Note: Process tree of a world] in _reaper.py.
        self._reaper = Reaper(env, os.path.join(self._dir, "reaper.log"))
        commands = []
        for rank in range(self.spec.world_size):
            open(self._log_paths[rank], "wb").close()
            argv = [
                sys.executable, "-m", "shardkit.testing._worker",
                "--address", f"{host}:{port}",
                "--rank", str(rank),
                "--world-size", str(self.spec.world_size),
                "--backend", self.spec.backend,
                "--store", store,
                "--parent", str(self._reaper.pid),
            ]  # fmt: skip
            commands.append(
                RankCommand(argv, {"SHARDKIT_TESTING_RANK": str(rank)}, self._log_paths[rank])
            )
        self._procs = self._reaper.start(commands)
        accepted: list[Connection] = []
        errors: list[BaseException] = []

        def accept_all() -> None:
            try:
                for _ in range(self.spec.world_size):
                    accepted.append(listener.accept())
            except BaseException as exc:
                errors.append(exc)

        acceptor = threading.Thread(target=accept_all, daemon=True)
        acceptor.start()
        deadline = time.monotonic() + startup_timeout
        while acceptor.is_alive() and time.monotonic() < deadline:
            acceptor.join(0.2)
            if any(p.exited for p in self._procs.values()):
                break
        listener.close()
        acceptor.join(1.0)
        if len(accepted) < self.spec.world_size:
            raise WorldStartError(
                f"only {len(accepted)} of {self.spec.world_size} ranks connected within "
                f"{startup_timeout:.0f}s{self._describe_dead()}\n{self._all_logs()}"
            )
        pending = list(accepted)
        while pending:
            remaining = deadline - time.monotonic()
            ready = wait(pending, timeout=max(remaining, 0.0))
            if not ready:
                raise WorldStartError(
                    f"ranks did not initialise the {self.spec.backend} process group within "
                    f"{startup_timeout:.0f}s{self._describe_dead()}\n{self._all_logs()}"
                )
            for ready_conn in ready:
                conn = next(c for c in pending if c is ready_conn)
                try:
                    hello = conn.recv()
                except (EOFError, OSError):
                    raise WorldStartError(
                        f"a rank exited during start-up{self._describe_dead()}\n{self._all_logs()}"
                    ) from None
                if not isinstance(hello, Ready):
                    raise WorldStartError(f"unexpected start-up message {hello!r}")
                if hello.error is not None:
                    raise WorldStartError(
                        f"rank {hello.rank} could not initialise the {self.spec.backend} "
                        f"process group:\n{hello.error}"
                    )
                self._conns[hello.rank] = conn
                pending.remove(conn)

    # -- run --------------------------------------------------------------------------------

    def run(self, path: str, qualname: str, kwargs_blob: bytes, timeout: float) -> JobReport:
        """Run one test body on every rank and collect the outcome (never raises for test
        failures: they are in the report). Discards the world on anything but a clean pass.

        An exception while waiting (``KeyboardInterrupt``) kills the world before propagating.
        """
        try:
            return self._run(path, qualname, kwargs_blob, timeout)
        except BaseException:
            self.kill()
            raise

    def _run(self, path: str, qualname: str, kwargs_blob: bytes, timeout: float) -> JobReport:
        self._next_job += 1
        job = RunJob(self._next_job, path, qualname, kwargs_blob, tuple(sys.path))
        offsets = {r: os.path.getsize(p) for r, p in self._log_paths.items()}
        report = JobReport()
        start = time.monotonic()
        for rank, conn in self._conns.items():
            try:
                conn.send(job)
            except OSError:
                report.died[rank] = self._procs[rank].returncode
        pending = {r: c for r, c in self._conns.items() if r not in report.died}
        deadline = start + timeout
        failure_at: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if failure_at is None else min(deadline, failure_at + _FAILURE_GRACE_S)
            if now >= limit:
                break
            ready = wait(list(pending.values()), timeout=limit - now)
            for ready_conn in ready:
                rank = next(r for r, c in pending.items() if c is ready_conn)
                conn = pending[rank]
                try:
                    result = conn.recv()
                except (EOFError, OSError):
                    proc = self._procs[rank]
                    proc.wait(1.0)
                    report.died[rank] = proc.returncode
                    del pending[rank]
                    failure_at = failure_at or time.monotonic()
                    continue
                if not isinstance(result, JobResult) or result.job_id != job.job_id:
                    continue
                report.results[rank] = result
                del pending[rank]
                if result.outcome == "failed" and failure_at is None:
                    failure_at = time.monotonic()
        report.elapsed_s = time.monotonic() - start
        report.still_running = tuple(sorted(pending))
        report.timed_out = bool(pending) and failure_at is None
        if pending:
            self._dump_stacks(pending)
        if not report.ok or not all(res.healthy for res in report.results.values()):
            self.kill()
        report.logs = {r: self._tail(r, offsets[r]) for r in self._log_paths}
        return report

    def _dump_stacks(self, ranks: dict[int, Connection]) -> None:
        for rank in ranks:
            proc = self._procs[rank]
            if not proc.exited and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(_STACK_GRACE_S)

    # -- teardown ---------------------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """Ask every rank to leave cleanly, then kill the world's whole process tree."""
        try:
            if self.alive:
                for conn in self._conns.values():
                    with contextlib.suppress(OSError):
                        conn.send(Shutdown())
                deadline = time.monotonic() + timeout
                for proc in self._procs.values():
                    proc.wait(deadline - time.monotonic())
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill the world's whole process tree: ranks, their children and the reaper. Idempotent.

        See [Note: Process tree of a world] in ``_reaper.py``.
        """
        self.alive = False
        if self._reaper is not None:
            self._reaper.kill()
        for conn in self._conns.values():
            with contextlib.suppress(OSError):
                conn.close()
        self._conns.clear()

    def cleanup_dir(self) -> None:
        """Remove the world's temporary directory (logs, store)."""
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pids(self) -> dict[int, int]:
        """Process id of each started rank."""
        return {r: p.pid for r, p in self._procs.items() if p.pid is not None}

    @property
    def reaper_pid(self) -> int | None:
        """Process id of the world's reaper (also its session and process group id)."""
        return None if self._reaper is None else self._reaper.pid

    # -- logs -------------------------------------------------------------------------------

    def _tail(self, rank: int, offset: int) -> str:
        try:
            with open(self._log_paths[rank], "rb") as log:
                log.seek(offset)
                text = log.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        if len(text) > _LOG_TAIL_CHARS:
            text = "[... earlier output cut ...]\n" + text[-_LOG_TAIL_CHARS:]
        return text

    def _all_logs(self) -> str:
        return "\n".join(f"--- rank {r} output ---\n{self._tail(r, 0)}" for r in self._log_paths)

    def _describe_dead(self) -> str:
        dead = {r: p.returncode for r, p in self._procs.items() if p.exited}
        text = ""
        if dead:
            text = " (exited: " + ", ".join(f"rank {r} code {c}" for r, c in dead.items()) + ")"
        if self._reaper is not None and self._reaper.errors:
            text += "\nreaper: " + "\n".join(self._reaper.errors)
        return text


class WorldPool:
    """The worlds of this pytest process, one per :class:`WorldSpec`."""

    def __init__(self) -> None:
        self._worlds: dict[WorldSpec, World] = {}
        self.started = 0
        """How many worlds this pool has started (tests use it to prove reuse)."""

    def get(self, spec: WorldSpec, startup_timeout: float) -> World:
        """A live world for ``spec``, started if there is none."""
        world = self._worlds.get(spec)
        if world is not None and world.alive:
            return world
        if world is not None:
            world.cleanup_dir()
        world = World(spec, startup_timeout)
        self.started += 1
        self._worlds[spec] = world
        return world

    def run(self, spec: WorldSpec, path: str, qualname: str, kwargs: dict[str, object],
            timeout: float, startup_timeout: float, deadline: float | None = None) -> JobReport:
        """Run a test body on the world for ``spec``, for at most ``timeout`` seconds and, if
        ``deadline`` (a ``time.monotonic()`` value) is given, not past it (at least a moment).

        See [Note: pytest-timeout and worlds] in ``_decorator.py``.
        """
        blob = pickle.dumps(kwargs)
        world = self.get(spec, startup_timeout)
        limit = timeout
        if deadline is not None:
            limit = min(timeout, max(deadline - time.monotonic(), _MIN_LIMIT_S))
        report = world.run(path, qualname, blob, limit)
        report.timeout_s = limit
        report.cut_short = limit < timeout
        return report

    def close_all(self) -> None:
        """Shut every world down (session end)."""
        worlds = list(self._worlds.values())
        self._worlds.clear()
        for world in worlds:
            world.close()
            world.cleanup_dir()


pool = WorldPool()
"""The process-wide pool used by :func:`shardkit.testing.world`."""

atexit.register(pool.close_all)
