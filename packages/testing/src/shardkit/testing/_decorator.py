"""The :func:`world` decorator: run a pytest test body on every rank of a world."""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from shardkit.testing._config import WorldSpec, default_timeout
from shardkit.testing._world import JobReport, pool

__all__ = ["free_port", "set_pytest_timeout", "set_session_timeout", "world"]

_F = TypeVar("_F", bound=Callable[..., Any])

_session_timeout: float | None = None
_STARTUP_TIMEOUT_S = 180.0
_RANK_ENV = "SHARDKIT_TESTING_RANK"

_pytest_timeout: tuple[float, float] | None = None
"""pytest-timeout's limit for the running test and the monotonic time it expires, if any."""

_PYTEST_TIMEOUT_MARGIN_S = 4.0
"""How long before pytest-timeout's deadline a @world test's own limit ends at most: enough for
the ranks' stacks and the report. See [Note: pytest-timeout and worlds]."""


def set_session_timeout(seconds: float | None) -> None:
    """Set the per-test timeout for this session (the plugin's ``--shardkit-timeout``)."""
    global _session_timeout
    if seconds is not None and seconds <= 0:
        raise ValueError(f"--shardkit-timeout must be positive, got {seconds}")
    _session_timeout = seconds


def set_pytest_timeout(seconds: float | None, deadline: float | None) -> None:
    """Record pytest-timeout's limit for the test about to run (the plugin calls it).

    [Note: pytest-timeout and worlds]
    pytest-timeout (``--timeout``, the ``timeout`` ini value or marker, ``PYTEST_TIMEOUT``)
    fails a test that runs too long by raising in the pytest process (``signal`` method) or by
    ending it (``thread`` method). Two things follow for @world tests:

    * Its limit is the default limit of a @world body (after an explicit ``timeout=`` and
      ``--shardkit-timeout``), and whatever the limit, the body's own deadline is moved to end
      ``min(4 s, limit / 4)`` before pytest-timeout's (which counts from the start of setup,
      world start-up included): the harness then reports first, with every rank's stack.
    * If pytest-timeout fires anyway (world start-up ate the budget, a very short limit), its
      exception reaches ``World.run`` (or ``World.__init__``) while the ranks still run the
      body; both kill the world's whole process tree before letting it through, so the next
      test gets a fresh world instead of one whose ranks are still busy. With the ``thread``
      method pytest itself exits and each world's reaper kills the tree (see [Note: Process
      tree of a world] in ``_reaper.py``).
    """
    global _pytest_timeout
    _pytest_timeout = None if seconds is None or deadline is None else (seconds, deadline)


def _limit(timeout: float | None) -> tuple[float, float | None]:
    """The body's limit in seconds and, under pytest-timeout, the deadline it must end by.

    See [Note: pytest-timeout and worlds].
    """
    pytest_timeout = _pytest_timeout
    if pytest_timeout is None:
        return timeout or _session_timeout or default_timeout(), None
    seconds, deadline = pytest_timeout
    limit = timeout or _session_timeout or seconds
    return limit, deadline - min(_PYTEST_TIMEOUT_MARGIN_S, seconds / 4)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for RPC or TCPStore in a test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def world(
    world_size: int = 2, *, backend: str = "gloo", timeout: float | None = None
) -> Callable[[_F], _F]:
    """Run the decorated test body on ``world_size`` ranks.

    The body runs in every rank process with the default process group initialised (use
    ``torch.distributed.get_rank()``). pytest fixtures and parameters are resolved in the
    pytest process and passed, pickled, to every rank. The test fails with the rank number and
    traceback when any rank raises, and within seconds after ``timeout`` with every rank's
    Python stack. Worlds are reused between tests with the same size and backend; a failed test
    discards its world.

    Args:
        world_size: Number of ranks (1 to 8).
        backend: ``"gloo"`` or ``"nccl"``; NCCL tests skip when fewer than ``world_size`` GPUs
            are visible.
        timeout: Seconds the body may run; defaults to ``--shardkit-timeout``, then
            pytest-timeout's limit for the test (``--timeout``, ini, marker), then the
            ``SHARDKIT_TEST_TIMEOUT`` environment variable, then 120. Under pytest-timeout the
            body's limit also ends a few seconds before pytest-timeout's, so the harness reports
            the ranks' stacks first (see [Note: pytest-timeout and worlds]).

    Raises:
        TypeError / ValueError: for a bad world size, backend or timeout, or a test that is not a
            module-level function or a method of a module-level class.
    """
    spec = WorldSpec(world_size, backend)
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")

    def decorate(fn: _F) -> _F:
        if not callable(fn):
            raise TypeError(f"@world decorates a test function, got {type(fn).__name__}")
        if "<locals>" in fn.__qualname__:
            raise ValueError(
                f"@world test {fn.__qualname__!r} is defined inside a function; rank processes "
                "import the test module by path, so define it at module level"
            )
        path = inspect.getfile(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            if os.environ.get(_RANK_ENV) is not None:
                # Already on a rank (a helper called the decorated test directly): just run it.
                fn(*args, **kwargs)
                return
            if len(args) > 1:
                raise TypeError(
                    f"@world test {fn.__qualname__} got positional arguments {args!r}; "
                    "pytest passes fixtures by keyword"
                )
            if backend == "nccl" and _gpu_count() < world_size:
                pytest.skip(
                    f"needs {world_size} CUDA GPU(s) for the NCCL backend, found {_gpu_count()}"
                )
            for name, value in kwargs.items():
                try:
                    pickle.dumps(value)
                except Exception as exc:
                    raise TypeError(
                        f"@world test {fn.__qualname__}: argument {name!r} of type "
                        f"{type(value).__name__} cannot be pickled to the rank processes "
                        f"({exc}); use a picklable fixture value (paths, numbers, strings)"
                    ) from None
            limit, deadline = _limit(timeout)
            report = pool.run(
                spec, path, fn.__qualname__, kwargs, limit, _STARTUP_TIMEOUT_S, deadline=deadline
            )
            _conclude(report, spec)

        wrapper._shardkit_body = fn  # type: ignore[attr-defined]  # noqa: SLF001
        wrapper._shardkit_world = spec  # type: ignore[attr-defined]  # noqa: SLF001
        marks = [pytest.mark.nccl] if backend == "nccl" else []
        decorated: Any = wrapper
        for mark in marks:
            decorated = mark(decorated)
        return decorated  # type: ignore[no-any-return]

    return decorate


def _conclude(report: JobReport, spec: WorldSpec) -> None:
    """Turn a report into pass, skip or a failure message naming ranks."""
    if report.ok:
        if report.skipped:
            rank, reason = next(iter(report.skipped.items()))
            pytest.skip(f"rank {rank}: {reason}")
        return
    lines: list[str] = []
    if report.timed_out:
        cut = " (cut to end before pytest-timeout's limit)" if report.cut_short else ""
        lines.append(
            f"timed out after {report.timeout_s:.0f}s{cut} on {spec.backend} world of "
            f"{spec.world_size}: ranks {list(report.still_running)} still running; their Python "
            f"stacks follow"
        )
    for rank, tb in report.failed.items():
        lines.append(f"rank {rank} of {spec.world_size} raised:\n{tb}")
    for rank, code in report.died.items():
        lines.append(f"rank {rank} of {spec.world_size} died (exit code {code})")
    if report.still_running and not report.timed_out:
        lines.append(
            f"ranks {list(report.still_running)} were still running after the failure "
            "(stopped; their stacks are in the output below)"
        )
    for rank, text in sorted(report.logs.items()):
        if text.strip():
            lines.append(f"----- rank {rank} output -----\n{text.rstrip()}")
    pytest.fail("\n".join(lines), pytrace=False)
