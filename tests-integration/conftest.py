"""Shared set-up of the cross-package integration suites.

The suites import their small shared model and training helpers from ``_gpt.py`` in this
folder. Rank processes of ``shardkit.testing.world`` receive the pytest process's ``sys.path``,
so putting this folder on it here makes ``import _gpt`` work in every rank as well (and objects
defined there pickle by reference between ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
