"""A reusable RPC world for shardkit-rpc's tests and benchmarks (not a test module).

[Note: One RPC session per world]
torch.distributed.rpc cannot be initialised again in a process where it was shut down (torch
2.13: the second session's RRef messages fail with "RPC is no longer running on this node"), so
the reused ``shardkit.testing`` worlds, which outlive any one test, cannot host RPC tests. An
:class:`RpcWorld` instead starts ``world_size`` processes that initialise the default (gloo)
process group *and* RPC once, then run many test bodies in that one RPC session, one job at a
time, until the world is closed (``rpc.shutdown()`` on every rank, graceful). A module-scoped
fixture owns one world, so process start-up is paid once per test module, not once per test.

Like ``shardkit.testing``: every rank runs every body (``body(rank, *args)``); each job has a
deadline; a rank that fails gives its peers a short grace period; ranks still running at the
deadline dump every thread's stack (faulthandler on SIGUSR1) into the failure report and the
world is killed (the next job starts a fresh one). Rank processes import the body's module by
file path under a name that is the same on every rank, so functions and classes defined there
pickle by reference over RPC; all ranks import it before any rank runs the body (a barrier).
Ranks exit when the pytest process goes away.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait
from types import ModuleType
from typing import Any

__all__ = ["RpcWorld", "RpcWorldError"]

_GRACE_S = 3.0
_STACK_GRACE_S = 1.5
_LOG_TAIL = 6000


class RpcWorldError(AssertionError):
    """A body failed, timed out or a rank died; the message has every rank's report."""


@dataclass(frozen=True)
class _Job:
    job_id: int
    path: str
    body: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class _Result:
    job_id: int
    rank: int
    ok: bool
    detail: str
    value: Any


@dataclass(frozen=True)
class _Shutdown:
    pass


# -- rank side ---------------------------------------------------------------------------------

_modules: dict[str, ModuleType] = {}


def _load(path: str) -> ModuleType:
    module = _modules.get(path)
    if module is None:
        name = "_shardkit_rpc_rank_" + hashlib.sha1(path.encode()).hexdigest()[:16]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {path!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _modules[path] = module
    return module


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def child_main(
    address: str,
    rank: int,
    world_size: int,
    directory: str,
    parent: int,
    rpc_timeout: float,
    threads: int,
) -> None:
    """Entry point of one rank (see [Note: One RPC session per world])."""
    import datetime
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("RPC_WORLD_KEY")))

    import torch
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(directory, "pg"), world_size)  # type: ignore[attr-defined]
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    options = rpc.TensorPipeRpcBackendOptions(
        init_method="file://" + os.path.join(directory, "rpc"),
        rpc_timeout=rpc_timeout,
        num_worker_threads=threads,
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            os._exit(4)
        if isinstance(job, _Shutdown):
            break
        print(f"===== job {job.job_id}: {job.body}", file=sys.stderr, flush=True)
        try:
            body = getattr(_load(job.path), job.body)
            dist.barrier()  # every rank can unpickle the module's objects before any RPC
            result = _Result(job.job_id, rank, True, "", body(rank, *job.args))
        except BaseException:
            result = _Result(job.job_id, rank, False, traceback.format_exc(), None)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(result)
    import gc

    gc.collect()  # no UserRRef may be collected after the agent stopped
    rpc.shutdown()
    dist.destroy_process_group()
    conn.send("bye")
    conn.close()


_BOOT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_shardkit_rpc_world", {path!r})
m = importlib.util.module_from_spec(spec)
sys.modules["_shardkit_rpc_world"] = m
spec.loader.exec_module(m)
m.child_main(sys.argv[1], *map(int, sys.argv[2:4]), sys.argv[4], int(sys.argv[5]),
             float(sys.argv[6]), int(sys.argv[7]))
"""


# -- pytest side -------------------------------------------------------------------------------


class RpcWorld:
    """``world_size`` ranks named ``worker0..`` sharing one RPC session, started on first use.

    Args:
        world_size: Number of rank processes.
        startup_timeout: Seconds for every rank to import torch and initialise gloo and RPC.
        rpc_timeout: The RPC agent's default timeout, seconds.
        threads: RPC server threads per rank.
    """

    def __init__(
        self,
        world_size: int,
        *,
        startup_timeout: float = 90.0,
        rpc_timeout: float = 60.0,
        threads: int = 16,
    ) -> None:
        self.world_size = world_size
        self.startup_timeout = startup_timeout
        self.rpc_timeout = rpc_timeout
        self.threads = threads
        self.starts = 0
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._logs: list[str] = []
        self._dir = ""
        self._next = 0

    @property
    def alive(self) -> bool:
        return bool(self._conns)

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="shardkit-rpc-world-")
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = listener.address
        env = {
            **os.environ,
            "RPC_WORLD_KEY": key.hex(),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        code = _BOOT.format(path=os.path.abspath(__file__))
        self._logs = [os.path.join(self._dir, f"rank{r}.log") for r in range(self.world_size)]
        for r in range(self.world_size):
            with open(self._logs[r], "wb") as log:
                self._procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            code,
                            f"{host}:{port}",
                            str(r),
                            str(self.world_size),
                            self._dir,
                            str(os.getpid()),
                            str(self.rpc_timeout),
                            str(self.threads),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
        self.starts += 1
        conns: list[Connection] = []

        def accept() -> None:
            with contextlib.suppress(OSError):
                for _ in range(self.world_size):
                    conns.append(listener.accept())

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        deadline = time.monotonic() + self.startup_timeout
        while acceptor.is_alive() and time.monotonic() < deadline:
            acceptor.join(0.2)
            if any(p.poll() is not None for p in self._procs):
                break
        listener.close()
        acceptor.join(1.0)
        pending = list(conns)
        while len(conns) == self.world_size and pending and time.monotonic() < deadline:
            for c in wait(pending, timeout=max(0.0, deadline - time.monotonic())):
                try:
                    c.recv()
                except (EOFError, OSError):
                    deadline = 0.0
                    break
                pending.remove(c)
            if any(p.poll() is not None for p in self._procs):
                break
        if len(conns) < self.world_size or pending:
            self._conns = conns
            report = self._report(dict.fromkeys(range(self.world_size), 0))
            self.kill()
            raise RpcWorldError(
                f"RPC world of {self.world_size} did not start within "
                f"{self.startup_timeout:.0f}s\n{report}"
            )
        # Connections arrive in any order: ask each which rank it is.
        self._conns = self._order(conns)

    def _order(self, conns: list[Connection]) -> list[Connection]:
        ordered: list[Connection | None] = [None] * self.world_size
        self._next += 1
        probe = _Job(self._next, os.path.abspath(__file__), "_whoami", ())
        for c in conns:
            c.send(probe)
        for c in conns:
            result = c.recv()
            ordered[result.rank] = c
        return [c for c in ordered if c is not None]

    def run(self, path: str, body: str, *args: Any, timeout: float = 60.0) -> list[Any]:
        """Run ``body(rank, *args)`` from the module at ``path`` on every rank.

        Returns:
            Each rank's return value, by rank.

        Raises:
            RpcWorldError: a rank failed, died or ran past ``timeout``; every rank's traceback,
                output and (after a timeout) thread stacks are in the message. The world is
                killed then, and the next call starts a fresh one.
        """
        if not self.alive:
            self._start()
        self._next += 1
        job = _Job(self._next, path, body, args)
        offsets = [os.path.getsize(p) for p in self._logs]
        results: dict[int, _Result] = {}
        died: list[int] = []
        for c in self._conns:
            c.send(job)
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while pending:
            limit = deadline if failed_at is None else min(deadline, failed_at + _GRACE_S)
            now = time.monotonic()
            if now >= limit:
                break
            for c in wait(list(pending.values()), timeout=limit - now):
                rank = next(r for r, x in pending.items() if x is c)
                del pending[rank]
                try:
                    result = c.recv()
                except (EOFError, OSError):
                    died.append(rank)
                    failed_at = failed_at or time.monotonic()
                    continue
                results[rank] = result
                if not result.ok:
                    failed_at = failed_at or time.monotonic()
        if not pending and not died and all(r.ok for r in results.values()):
            return [results[r].value for r in range(self.world_size)]
        if pending:
            for rank in pending:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._procs[rank].pid, signal.SIGUSR1)
            time.sleep(_STACK_GRACE_S)
        verdict = f"timed out after {timeout:.0f}s" if pending and failed_at is None else "failed"
        lines = [f"{body} {verdict}"]
        for rank in range(self.world_size):
            res = results.get(rank)
            state = (
                ("passed" if res.ok else "FAILED")
                if res
                else ("died" if rank in died else "still running (stacks below)")
            )
            lines.append(f"----- rank {rank}: {state}")
            if res is not None and not res.ok:
                lines.append(res.detail)
        lines.append(self._report(dict(enumerate(offsets))))
        self.kill()
        raise RpcWorldError("\n".join(lines))

    def _report(self, offsets: dict[int, int]) -> str:
        out = []
        for rank, offset in offsets.items():
            try:
                with open(self._logs[rank], "rb") as f:
                    f.seek(offset)
                    text = f.read().decode(errors="replace")
            except OSError:
                text = ""
            out.append(f"----- rank {rank} output -----\n{text[-_LOG_TAIL:]}")
        return "\n".join(out)

    def close(self, timeout: float = 30.0) -> None:
        """Shut RPC down on every rank (graceful), then kill whatever is left."""
        if self.alive:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.send(_Shutdown())
            deadline = time.monotonic() + timeout
            for p in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.1, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank's process group and remove the world's directory."""
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5.0)
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()
        self._procs, self._conns = [], []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""


def _whoami(rank: int) -> int:
    return rank
