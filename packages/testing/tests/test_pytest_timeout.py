"""@world tests under pytest-timeout: its limit is honoured, and a world it interrupts is discarded.

See [Note: pytest-timeout and worlds] in ``shardkit/testing/_decorator.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_timeout", reason="pytest-timeout is a test-only companion plugin")

_INNER = """
import time

import pytest
import torch.distributed as dist
from shardkit.testing import pool, world


@pytest.mark.timeout(240)
@world(2)
def test_warm():
    dist.barrier()


@world(2)  # no timeout of its own: --timeout=16 is its default limit
def test_hangs_under_default_limit():
    time.sleep(600)


@pytest.mark.timeout(240)
@world(2)
def test_fresh_world_after_harness_timeout():
    dist.barrier()


@pytest.mark.timeout(3)  # shorter than the stack dump after the cut limit: pytest-timeout fires
@world(2, timeout=300)
def test_interrupted_by_pytest_timeout():
    time.sleep(600)


@pytest.mark.timeout(240)
@world(2)
def test_fresh_world_after_pytest_timeout():
    dist.barrier()


def test_three_worlds_were_started():
    assert pool.started == 3
"""


def test_pytest_timeout_limit_and_discarded_world(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_INNER)
    result = pytester.runpytest_subprocess(
        "-q", "-p", "no:cacheprovider", "--timeout=16", "--timeout-method=signal"
    )
    out = result.stdout.str()
    result.assert_outcomes(failed=2, passed=4)
    # --timeout is the default limit, cut 4 s short so the harness reports the ranks' stacks.
    assert "test_hangs_under_default_limit" in out
    assert "(cut to end before pytest-timeout's limit)" in out
    assert "still running; their Python stacks follow" in out
    # pytest-timeout itself interrupted the other hanging test ...
    assert "Timeout (>3.0s) from pytest-timeout" in out
    # ... and the tests after each hang ran on fresh worlds (the old one would still be busy
    # sleeping and time out too); test_three_worlds_were_started checks the count.
    for name in (
        "test_fresh_world_after_harness_timeout",
        "test_fresh_world_after_pytest_timeout",
        "test_three_worlds_were_started",
    ):
        assert f"FAILED test_pytest_timeout_limit_and_discarded_world.py::{name}" not in out
