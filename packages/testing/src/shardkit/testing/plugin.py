"""pytest plugin entry point (registered as ``pytest11: shardkit``).

Adds ``--shardkit-timeout``, registers the ``nccl``/``cuda`` markers, skips ``cuda``-marked
tests without a GPU, and tears every world down at the end of the session.
"""

from __future__ import annotations

import pytest
from shardkit.testing._decorator import set_session_timeout
from shardkit.testing._world import pool

__all__ = [
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    pool.close_all()
