"""Entry point of a rank process: ``python -m shardkit.testing._worker``.

A rank is started by its world's reaper (``_reaper.py``), connects back to the pytest process,
initialises the default process group through a :class:`torch.distributed.FileStore` in a
directory owned by its world, then runs test bodies until told to stop.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from multiprocessing.connection import Client, Connection
from types import ModuleType
from typing import Any

from shardkit.testing._protocol import JobResult, Ready, RunJob, Shutdown

__all__ = ["main"]

_modules: dict[str, ModuleType] = {}


def _watch_parent(parent_pid: int) -> None:
    """Exit when the world's reaper goes away, where the kernel would not kill this rank.

    The reaper starts every rank with ``PR_SET_PDEATHSIG`` (``SIGKILL``), which works even while
    the rank holds the GIL; this daemon thread is the fallback on platforms without prctl. See
    [Note: Process tree of a world] in ``_reaper.py``.
    """
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)


def _load_module(path: str) -> ModuleType:
    module = _modules.get(path)
    if module is not None:
        return module
    # Same name on every rank (hash() is randomised per process): objects defined in the test
    # module then pickle by reference between ranks.
    name = "_shardkit_rank_test_" + hashlib.sha1(path.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the test module at {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _modules[path] = module
    return module


def _resolve(module: ModuleType, qualname: str) -> Any:
    parts = qualname.split(".")
    obj: Any = module
    owner: Any = None
    for part in parts:
        owner = obj
        obj = getattr(obj, part)
    # The decorated test is a wrapper; the body is what it wraps.
    body = getattr(obj, "_shardkit_body", obj)
    if isinstance(owner, type):
        return body.__get__(owner(), owner)
    return body


def _run(job: RunJob, rank: int) -> JobResult:
    import pytest
    import torch.distributed as dist

    for entry in job.sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    outcome, detail = "passed", ""
    kwargs: dict[str, Any] = {}
    try:
        kwargs = pickle.loads(job.kwargs_blob)
        body = _resolve(_load_module(job.path), job.qualname)
        # A job's warnings filters (torch's Join.__exit__ calls warnings.simplefilter("once"))
        # must not outlive it on a reused rank: they would shadow the PYTHONWARNINGS rules of
        # every later job.
        with warnings.catch_warnings():
            body(**kwargs)
    except BaseException as exc:
        if isinstance(exc, pytest.skip.Exception):
            outcome, detail = "skipped", str(getattr(exc, "msg", exc))
        else:
            outcome, detail = "failed", traceback.format_exc()
    finally:
        # [Note: Fixtures with teardown on reused ranks]
        # A fixture value reaches the ranks as a pickled copy, so its teardown in the pytest
        # process cannot undo what the body did with it on a rank: a monkeypatch would leak
        # into every later test of the (reused) world. Undo rank-side patches here.
        for value in kwargs.values():
            if isinstance(value, pytest.MonkeyPatch):
                value.undo()
    sys.stdout.flush()
    sys.stderr.flush()
    healthy = dist.is_initialized()
    return JobResult(job.job_id, rank, outcome, detail, healthy)


def main(argv: list[str] | None = None) -> int:
    """Run one rank of a world until :class:`Shutdown` arrives or the connection closes."""
    parser = argparse.ArgumentParser(prog="shardkit.testing._worker")
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)

    # Stacks of every thread on SIGUSR1 (the pytest process asks for them on a timeout) and on
    # a fatal signal (a rank that dies by SIGSEGV shows where in its output).
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    threading.Thread(target=_watch_parent, args=(args.parent,), daemon=True).start()

    host, port = args.address.rsplit(":", 1)
    authkey = bytes.fromhex(os.environ.pop("SHARDKIT_TESTING_AUTHKEY"))
    conn: Connection = Client((host, int(port)), authkey=authkey)
    try:
        import torch
        import torch.distributed as dist

        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // args.world_size))
        if args.backend == "nccl":
            torch.cuda.set_device(args.rank % torch.cuda.device_count())
        store = dist.FileStore(args.store, args.world_size)  # type: ignore[attr-defined]
        dist.init_process_group(
            args.backend,
            store=store,
            rank=args.rank,
            world_size=args.world_size,
            timeout=datetime.timedelta(seconds=600),
        )
    except BaseException:
        conn.send(Ready(args.rank, os.getpid(), traceback.format_exc()))
        return 1
    conn.send(Ready(args.rank, os.getpid()))

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if isinstance(message, Shutdown):
            break
        if isinstance(message, RunJob):
            print(f"===== shardkit.testing job {message.job_id}: {message.qualname}",
                  file=sys.stderr, flush=True)
            conn.send(_run(message, args.rank))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
