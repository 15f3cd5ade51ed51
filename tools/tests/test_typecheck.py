"""tools/typecheck.py against a fake monorepo with its own mypy config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import typecheck

MakePackage = Callable[..., Path]

_CONFIG = """\
[tool.mypy]
strict = true
explicit_package_bases = true
namespace_packages = true
mypy_path = ["packages/good/src", "packages/bad/src"]
"""


def test_per_package_results(
    repo: Path, make_package: MakePackage, capsys: pytest.CaptureFixture[str]
) -> None:
    (repo / "pyproject.toml").write_text(_CONFIG)
    make_package("good", deps=[], modules={"_a.py": "def f(x: int) -> int:\n    return x + 1\n"})
    make_package(
        "bad",
        deps=[],
        modules={
            "_b.py": "def g(x):\n    return x\n",
            "_c.py": "from shardkit.good._a import f\n\ny: str = f(1)\n",
        },
    )
    rc = typecheck.main(["--root", str(repo)])
    out = capsys.readouterr().out
    assert rc == 1, out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  shardkit-")}
    assert lines["shardkit-good"].endswith(" ok")
    assert lines["shardkit-bad"].endswith("FAIL (2 errors)")
    assert (
        "packages/bad/src/shardkit/bad/_b.py:1: error: Function is missing a type annotation" in out
    )
    assert "packages/bad/src/shardkit/bad/_c.py:3: error: Incompatible types in assignment" in out
    assert "FAILED: bad" in out

    # One process per package: the clean package alone passes, the broken one alone fails.
    assert typecheck.main(["--root", str(repo), "--separate", "--package", "good"]) == 0
    assert "one process per package" in capsys.readouterr().out
    (repo / "packages/bad/src/shardkit/bad/_b.py").write_text(
        "def g(x: int) -> int:\n    return x\n"
    )
    (repo / "packages/bad/src/shardkit/bad/_c.py").write_text("X = 1\n")
    assert typecheck.main(["--root", str(repo), "--separate"]) == 0
    assert "all packages clean" in capsys.readouterr().out


def test_bad_arguments(
    repo: Path, make_package: MakePackage, capsys: pytest.CaptureFixture[str]
) -> None:
    make_package("good", deps=[])
    assert typecheck.main(["--root", str(repo), "--package", "nope"]) == 2
    assert "unknown package 'nope'; the packages are: good" in capsys.readouterr().err
    # A broken mypy configuration is a crash (status 2), not a type error.
    (repo / "pyproject.toml").write_text(
        "[tool.mypy]\nstrict = 'maybe'\nplugins = ['no_such_plugin']\n"
    )
    assert typecheck.main(["--root", str(repo)]) == 2
    assert "mypy did not complete" in capsys.readouterr().out
