"""The RPC test harness (_rpc_world.py) reports failures and hangs instead of hanging itself."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

_PATH = os.path.abspath(__file__)


def _body_rank(rank: int) -> int:
    return rank * 10


def _body_fail_or_hang(rank: int) -> None:
    if rank == 0:
        raise ValueError("boom from rank 0")
    time.sleep(120)  # rank 1 never answers


def test_failure_and_hang_are_reported_with_stacks(rpc_world_class: Any) -> None:
    """A failing rank's traceback and a hanging rank's thread stacks are in the error, within
    the failure grace period (not the job timeout), and the world is torn down."""
    world = rpc_world_class(2)
    try:
        assert world.run(_PATH, "_body_rank") == [0, 10]  # started; values come back by rank
        start = time.monotonic()
        with pytest.raises(AssertionError) as info:
            world.run(_PATH, "_body_fail_or_hang", timeout=60)
        elapsed = time.monotonic() - start
        text = str(info.value)
        assert "----- rank 0: FAILED" in text and "ValueError: boom from rank 0" in text
        assert "----- rank 1: still running" in text
        assert "in _body_fail_or_hang" in text  # rank 1's faulthandler stack
        assert not world.alive and world.starts == 1
        assert elapsed < 30, elapsed  # 3 s grace + 1.5 s for stacks, not the 60 s timeout
    finally:
        world.close()
