"""Shared set-up of shardkit-optim's tests.

The tests import their small training and comparison helpers from ``_optim_testkit.py`` in this
folder. Rank processes of ``shardkit.testing.world`` receive the pytest process's ``sys.path``, so
putting this folder on it here makes the import work in every rank as well.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
