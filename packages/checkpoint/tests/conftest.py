"""Shared set-up of shardkit-checkpoint's tests.

The tests import their helpers from ``_ckpt_testkit.py`` and ``_fuzzkit.py`` in this folder.
Rank processes of ``shardkit.testing.world`` receive the pytest process's ``sys.path``, so
putting this folder on it here makes the import work in every rank as well.

These tests need torch, shardkit-checkpoint and (test-only) shardkit-testing, pytest,
hypothesis and NumPy: nothing else of shardkit (``hatch run pkg.checkpoint:test``).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
