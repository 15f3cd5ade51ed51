"""``tools/check_packages.py`` as a module, for the suites that build and install wheels."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["ROOT", "check_packages_tool"]

ROOT = Path(__file__).resolve().parents[1]


def check_packages_tool() -> ModuleType:
    """``tools/check_packages.py``, loaded once per process."""
    name = "_shardkit_tools_check_packages"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "check_packages.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
