"""Fixtures for shardkit-rpc's benchmarks: the tests' RPC world fixture, reused as is."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "_shardkit_rpc_tests_conftest"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        _NAME, Path(__file__).resolve().parent.parent / "tests" / "conftest.py"
    )
    if _spec is None or _spec.loader is None:
        raise ImportError("cannot load packages/rpc/tests/conftest.py")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)

rpc_world = sys.modules[_NAME].rpc_world
