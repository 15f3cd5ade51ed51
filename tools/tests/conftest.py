"""Fixtures for the repository tools' tests: a throwaway fake monorepo under tmp_path."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

MakePackage = Callable[..., Path]

_PYPROJECT = """\
[build-system]
requires = ["hatchling>=1.27"]
build-backend = "hatchling.build"

[project]
name = "shardkit-{name}"
dynamic = ["version"]
description = "fake package {name}"
requires-python = ">=3.10"
license = "BSD-3-Clause"
license-files = ["LICENSE"]
classifiers = [
  "Programming Language :: Python :: 3.10",
  "Programming Language :: Python :: 3.11",
]
# dependencies of the fake package
dependencies = [
{deps}]

[project.urls]
Repository = "https://github.com/shardkit/shardkit"

[tool.hatch.version]
path = "src/shardkit/{name}/__about__.py"

[tool.hatch.build.targets.wheel]
packages = ["src/shardkit"]
"""


def write_package(
    root: Path,
    name: str,
    deps: Sequence[str] = ("torch>=2.4",),
    version: str = "0.1.0",
    modules: Mapping[str, str] | None = None,
) -> Path:
    """Create packages/<name>/ with pyproject, README, LICENSE, CHANGELOG, __about__, `modules`."""
    pkg = root / "packages" / name
    src = pkg / "src" / "shardkit" / name
    src.mkdir(parents=True, exist_ok=True)
    dep_lines = "".join(f'  "{d}",\n' for d in deps)
    (pkg / "pyproject.toml").write_text(_PYPROJECT.format(name=name, deps=dep_lines))
    (pkg / "README.md").write_text(f"# shardkit-{name}\n")
    (pkg / "LICENSE").write_text("BSD 3-Clause License\n\nCopyright (c) shardkit developers\n")
    (pkg / "CHANGELOG.md").write_text(
        f"# Changelog\n\n## [Unreleased]\n\n## [{version}] - 2024-01-01\n\n### Added\n\n"
        "- First release.\n"
    )
    (src / "__about__.py").write_text(
        f'"""Version."""\n\n__all__ = ["__version__"]\n\n__version__ = "{version}"\n'
    )
    (src / "py.typed").write_text("")
    files = {
        "__init__.py": '"""Fake package."""\n\nfrom .__about__ import __version__\n\n__all__ = ["__version__"]\n'
    }
    files.update(modules or {})
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return pkg


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """An empty fake monorepo root (packages/ only)."""
    (tmp_path / "packages").mkdir()
    return tmp_path


@pytest.fixture
def make_package(repo: Path) -> MakePackage:
    """`make_package(name, deps=..., version=..., modules={...})` inside the `repo` fixture."""

    def make(name: str, **kwargs: object) -> Path:
        return write_package(repo, name, **kwargs)  # type: ignore[arg-type]

    return make


@pytest.fixture
def three_packages(repo: Path) -> Path:
    """core <- mid <- top: mid needs core; top needs mid and core (like buckets/optim/overlap)."""
    write_package(repo, "core")
    write_package(repo, "mid", deps=["torch>=2.4", "shardkit-core>=0.1,<0.2"])
    write_package(
        repo, "top", deps=["torch>=2.4", "shardkit-core>=0.1,<0.2", "shardkit-mid>=0.1,<0.2"]
    )
    return repo
