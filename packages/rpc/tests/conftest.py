"""Fixtures for shardkit-rpc's tests: one RPC world per test module (see _rpc_world.py)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _load_rpc_world() -> Any:
    # Registered under the name the rank processes use, so its job messages unpickle on both sides.
    name = "_shardkit_rpc_world"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("_rpc_world.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def rpc_world(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Three ranks (worker0 = trainer, worker1/worker2 = owners) in one RPC session per module."""
    world = _load_rpc_world().RpcWorld(3)
    try:
        yield world
    finally:
        world.close()


@pytest.fixture(scope="session")
def rpc_world_class() -> Any:
    """The RpcWorld class itself, for tests of the harness."""
    return _load_rpc_world().RpcWorld
