"""``captured_logs``: caplog's job inside a rank body."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from shardkit.testing import LogCapture, captured_logs, world


@given(level=st.sampled_from([logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR]))
def test_captures_at_and_above_its_level_and_restores_the_logger(level: int) -> None:
    log = logging.getLogger("shardkit.testing.example")
    log.setLevel(logging.CRITICAL)
    with captured_logs("shardkit.testing.example", level) as logs:
        for lv in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
            logging.getLogger("shardkit.testing.example.child").log(lv, "at %d", lv)
    assert isinstance(logs, LogCapture)
    assert logs.messages() == [f"at {lv}" for lv in (10, 20, 30, 40) if lv >= level]
    assert logs.matching("at 40") == ["at 40"]
    assert log.level == logging.CRITICAL
    assert logs not in log.handlers
    log.info("after the block")
    assert "after the block" not in logs.messages()


def test_bad_arguments_raise() -> None:
    with pytest.raises(TypeError, match="name must be a logger name"), captured_logs(3):  # type: ignore[arg-type]
        pass
    with (
        pytest.raises(TypeError, match="level must be a logging level int"),
        captured_logs(
            "x",
            "DEBUG",  # type: ignore[arg-type]
        ),
    ):
        pass


@world(2)
def test_captures_inside_a_rank_body() -> None:
    with captured_logs("shardkit.testing.rank") as logs:
        logging.getLogger("shardkit.testing.rank").debug("rank %d", dist.get_rank())
    assert logs.messages() == [f"rank {dist.get_rank()}"]
