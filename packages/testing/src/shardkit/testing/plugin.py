"""pytest plugin entry point (registered as ``pytest11: shardkit``).

Adds ``--shardkit-timeout``, registers the ``nccl``/``cuda`` markers, skips ``cuda``-marked
tests without a GPU, passes pytest-timeout's limit of each test to ``@world`` (see
[Note: pytest-timeout and worlds] in ``_decorator.py``), and tears every world down at the end
of the session.
"""

from __future__ import annotations

import os
import time

import pytest
from shardkit.testing._decorator import set_pytest_timeout, set_session_timeout
from shardkit.testing._world import pool

__all__ = [
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_runtest_call",
    "pytest_runtest_protocol",
    "pytest_sessionfinish",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardkit", "shardkit multi-rank tests")
    group.addoption(
        "--shardkit-timeout",
        type=float,
        default=None,
        help="per-test timeout in seconds for @world tests (default: SHARDKIT_TEST_TIMEOUT or 120)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "nccl: needs NCCL and CUDA GPUs (skipped otherwise)")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped otherwise)")
    set_session_timeout(config.getoption("--shardkit-timeout"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def _pytest_timeout(item: pytest.Item) -> tuple[float, bool] | None:
    """pytest-timeout's limit for ``item`` and whether it times the call phase only.

    Read the way pytest-timeout reads it (marker, then ``--timeout``, ``PYTEST_TIMEOUT``, the
    ``timeout`` ini value); None when the plugin is not active or sets no limit. pytest-timeout
    is not imported: it is an optional companion, not a dependency.
    """
    config = item.config
    if not config.pluginmanager.hasplugin("timeout"):
        return None
    raw: object = None
    func_only: object = None
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        raw = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        func_only = marker.kwargs.get("func_only")
    if raw is None:
        raw = config.getoption("timeout", None)
    if raw is None:
        raw = os.environ.get("PYTEST_TIMEOUT") or None
    if raw is None:
        raw = config.getini("timeout")
    if func_only is None:
        func_only = config.getini("timeout_func_only")
    try:
        seconds = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None  # pytest-timeout reports a malformed value itself
    return (seconds, bool(func_only)) if seconds > 0 else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # pytest-timeout's timer starts here too, unless it times the call phase only.
    settings = _pytest_timeout(item)
    if settings is None or settings[1]:
        set_pytest_timeout(None, None)
    else:
        set_pytest_timeout(settings[0], time.monotonic() + settings[0])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    settings = _pytest_timeout(item)
    if settings is not None and settings[1]:
        set_pytest_timeout(settings[0], time.monotonic() + settings[0])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    pool.close_all()
