"""tools/check_packages.py against fake monorepos (and a smoke run on the real tree)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import check_packages
import pytest
from _monorepo import load_packages

MakePackage = Callable[..., Path]


def _row(out: str, name: str) -> list[str]:
    """The table row of shardkit-<name> split into cells."""
    for line in out.splitlines():
        if line.startswith(f"shardkit-{name} "):
            return line.split()
    raise AssertionError(f"no row for shardkit-{name} in:\n{out}")


def _static(root: Path) -> dict[str, list[str]]:
    results = check_packages.static_check(load_packages(root), root)
    return {name: r.static for name, r in results.items()}


def test_clean_repo_passes(three_packages: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pkg = three_packages / "packages" / "top" / "src" / "shardkit" / "top"
    (pkg / "_impl.py").write_text(
        "from __future__ import annotations\n"
        "import os, typing\nimport torch\nfrom torch import nn\n"
        "from shardkit.core import __version__\nfrom ..mid import __about__\n"
        "from . import __about__ as me\nfrom .sub.leaf import x\n"
        "def f() -> None:\n    import importlib\n    importlib.import_module('shardkit.mid')\n"
    )
    (pkg / "sub").mkdir()
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text(
        "from ...core import __about__\nfrom .. import _impl\nx = 1\n"
    )
    rc = check_packages.main(["--static-only", "--root", str(three_packages)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert _row(out, "top")[:5] == ["shardkit-top", "0.1.0", "core,mid", "ok", "-"]
    assert "all packages ok" in out


def test_undeclared_sibling_imports_are_found_everywhere(
    repo: Path, make_package: MakePackage
) -> None:
    make_package("core")
    make_package("other")
    make_package(
        "user",
        modules={
            "_a.py": "import shardkit.other.thing\n",
            "_b.py": "def f():\n    from shardkit import other\n",
            "_c.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from shardkit.core import X\n"
            ),
            "_d.py": "from .. import core\n",
            "_e.py": "import importlib\nm = importlib.import_module('shardkit.core._x')\n",
            "_f.py": "from ... import nothing\n",
            "_g.py": "import shardkit.ghost\n",
        },
    )
    problems = _static(repo)["user"]
    text = "\n".join(problems)
    assert (
        "packages/user/src/shardkit/user/_a.py:1: imports 'shardkit.other.thing' but shardkit-other is not in [project].dependencies"
        in text
    )
    assert "_b.py:2: imports 'shardkit.other'" in text
    assert "_c.py:3: imports 'shardkit.core'" in text
    assert "_d.py:1: imports 'shardkit.core'" in text
    assert "_e.py:2: imports 'shardkit.core._x'" in text
    assert "_f.py:1: relative import 'from ... import ...' goes above the top-level package" in text
    assert "_g.py:1: imports 'shardkit.ghost', but there is no package shardkit-ghost" in text
    assert len(problems) == 7, problems
    assert _static(repo)["core"] == [] and _static(repo)["other"] == []


def test_third_party_imports_must_be_declared(repo: Path, make_package: MakePackage) -> None:
    make_package(
        "tp",
        deps=["torch>=2.4", "pytest>=7"],
        modules={
            "_m.py": (
                "import json, collections.abc\nimport pytest\nimport _pytest.fixtures\n"
                "import torch.distributed as dist\nimport numpy as np\nimport definitely_missing\n"
            )
        },
    )
    make_package("notorch", deps=[], modules={"_m.py": "import torch\n"})
    problems = _static(repo)
    assert problems["tp"] == [
        "packages/tp/src/shardkit/tp/_m.py:5: imports 'numpy' (from numpy), which is neither the "
        "standard library nor declared in [project].dependencies; declare it or remove the import",
        "packages/tp/src/shardkit/tp/_m.py:6: imports 'definitely_missing' (from a distribution "
        "not installed here), which is neither the standard library nor declared in "
        "[project].dependencies; declare it or remove the import",
    ]
    assert (
        len(problems["notorch"]) == 1 and "imports 'torch' (from torch)" in problems["notorch"][0]
    )


def test_a_package_never_released_lists_its_changes_under_unreleased(
    repo: Path, make_package: MakePackage
) -> None:
    """A new package's CHANGELOG has no version heading until its first release (the release
    tool writes it); its entries under Unreleased are what the release records. Without entries,
    or once any version was released, the heading of the current version is required."""
    fresh = make_package("fresh")
    log = fresh / "CHANGELOG.md"
    log.write_text("# Changelog\n\n## [Unreleased]\n\n### Added\n\n- All of it.\n")
    assert _static(repo)["fresh"] == []
    log.write_text("# Changelog\n\n## [Unreleased]\n")
    assert any("no heading for the current version" in p for p in _static(repo)["fresh"])
    log.write_text("# Changelog\n\n## [Unreleased]\n\n- Next.\n\n## [0.0.9] - 2024-01-01\n")
    assert any("no heading for the current version" in p for p in _static(repo)["fresh"])


def test_layout_rules(repo: Path, make_package: MakePackage) -> None:
    core = make_package("core", version="0.2.0")
    (core.parent.parent / "packages/core/src/shardkit/__init__.py").write_text("")
    (core / "src/shardkit/core/py.typed").unlink()
    (core / "CHANGELOG.md").write_text("# Changelog\n\n## 0.1.0\n\n- old\n\n0.2.0 is coming\n")
    pinned = make_package("pinned", deps=["torch", "shardkit-core==0.2.0"])
    (pinned / "README.md").unlink()
    make_package("stale", deps=["torch", "shardkit-core>=0.1,<0.2"])
    make_package("open", deps=["torch", "shardkit-core>=0.1"])
    vers = make_package("vers")
    text = (vers / "pyproject.toml").read_text()
    (vers / "pyproject.toml").write_text(text.replace('dynamic = ["version"]', 'version = "9.9"'))
    problems = _static(repo)
    assert any("src/shardkit/__init__.py exists" in p for p in problems["core"])
    assert any("py.typed is missing" in p for p in problems["core"])
    assert any("no heading for the current version 0.2.0" in p for p in problems["core"])
    assert len(problems["core"]) == 3, problems["core"]
    assert problems["pinned"] == [
        "packages/pinned/README.md is missing",
        "[project.dependencies] 'shardkit-core==0.2.0': exact pin; siblings depend on each other "
        "by ranges such as 'shardkit-core>=0.1,<0.2'",
    ]
    assert (
        len(problems["stale"]) == 1
        and "does not admit the current shardkit-core 0.2.0" in problems["stale"][0]
    )
    assert len(problems["open"]) == 1 and "unbounded range" in problems["open"][0]
    assert (
        len(problems["vers"]) == 1
        and "[project].version is '9.9' but __about__.py says '0.1.0'" in problems["vers"][0]
    )


def test_packaging_metadata_rules(repo: Path, make_package: MakePackage) -> None:
    (repo / "LICENSE").write_text("BSD 3-Clause License\n\nCopyright (c) shardkit developers\n")
    nolicense = make_package("nolicense")
    (nolicense / "LICENSE").unlink()
    text = (nolicense / "pyproject.toml").read_text()
    (nolicense / "pyproject.toml").write_text(text.replace('license-files = ["LICENSE"]\n', ""))
    other = make_package("other")
    (other / "LICENSE").write_text("MIT License\n")
    pys = make_package("pys")
    text = (pys / "pyproject.toml").read_text()
    text = text.replace(
        '"Programming Language :: Python :: 3.10",', '"Programming Language :: Python :: 3.9",'
    )
    text = text.replace('[project.urls]\nRepository = "https://github.com/shardkit/shardkit"\n', "")
    (pys / "pyproject.toml").write_text(text)
    problems = _static(repo)
    assert len(problems["nolicense"]) == 2, problems["nolicense"]
    assert "packages/nolicense/LICENSE is missing" in problems["nolicense"][0]
    assert "license-files is None" in problems["nolicense"][1]
    assert problems["other"] == [
        "packages/other/LICENSE differs from the repository's LICENSE: copy it again"
    ]
    assert len(problems["pys"]) == 3, problems["pys"]
    assert (
        "classifiers name Python 3.9, which requires-python '>=3.10' excludes" in problems["pys"][0]
    )
    assert "no 'Programming Language :: Python :: 3.10' classifier" in problems["pys"][1]
    assert "[project.urls] is missing" in problems["pys"][2]


def test_relative_readme_links_are_refused(repo: Path, make_package: MakePackage) -> None:
    pkg = make_package("core")
    (repo / "docs").mkdir()
    (pkg / "README.md").write_text(
        "# shardkit-core\n\n"
        "Guide: [docs](../../docs/core.md#usage), ![plot](../../docs)\n"
        "[ok](https://example.org/x) [anchor](#usage) <mailto:a@b.c> `[code](not/a/link.md)`\n"
        "```\n[in a fence](x.md)\n```\n"
        '[ref]: CHANGELOG.md\n<a href="LICENSE">license</a>\n'
    )
    problems = _static(repo)["core"]
    base = "https://github.com/shardkit/shardkit"
    assert problems == [
        "packages/core/README.md:3: relative link '../../docs/core.md#usage' is dead on a package "
        f"index page; use the absolute URL {base}/blob/main/docs/core.md#usage",
        "packages/core/README.md:3: relative link '../../docs' is dead on a package index page; "
        f"use the absolute URL {base}/tree/main/docs",
        "packages/core/README.md:8: relative link 'CHANGELOG.md' is dead on a package index page; "
        f"use the absolute URL {base}/blob/main/packages/core/CHANGELOG.md",
        "packages/core/README.md:9: relative link 'LICENSE' is dead on a package index page; "
        f"use the absolute URL {base}/blob/main/packages/core/LICENSE",
    ]


def test_real_package_readmes_have_no_relative_links() -> None:
    root = Path(__file__).resolve().parents[2]
    found = [
        f"packages/{pkg.name}/{problem}"
        for pkg in load_packages(root)
        if (pkg.path / "README.md").is_file()
        for problem in check_packages.readme_link_problems(pkg.path / "README.md", root)
    ]
    assert not found, "\n".join(found)


def test_cycles_and_missing_siblings(repo: Path, make_package: MakePackage) -> None:
    make_package("a", deps=["torch", "shardkit-b>=0.1,<0.2"])
    make_package("b", deps=["torch", "shardkit-a>=0.1,<0.2", "shardkit-zzz>=0.1,<0.2"])
    problems = _static(repo)
    assert "dependency cycle: shardkit-a -> shardkit-b -> shardkit-a" in problems["a"]
    assert "dependency cycle: shardkit-a -> shardkit-b -> shardkit-a" in problems["b"]
    assert (
        "[project.dependencies] 'shardkit-zzz>=0.1,<0.2': there is no packages/zzz/ in this repository"
        in problems["b"]
    )


def test_failures_exit_non_zero_with_details(
    repo: Path, make_package: MakePackage, capsys: pytest.CaptureFixture[str]
) -> None:
    make_package("core")
    make_package("user", modules={"_x.py": "import shardkit.core\n"})
    assert check_packages.main(["--static-only", "--root", str(repo), "--package", "core"]) == 0
    capsys.readouterr()
    assert check_packages.main(["--static-only", "--root", str(repo)]) == 1
    out = capsys.readouterr().out
    assert _row(out, "user")[:5] == ["shardkit-user", "0.1.0", "-", "FAIL", "-"]
    assert "  - packages/user/src/shardkit/user/_x.py:1: imports 'shardkit.core'" in out
    assert "1 of 2 packages FAILED" in out
    assert check_packages.main(["--static-only", "--root", str(repo), "--package", "nope"]) == 2
    assert "unknown package 'nope'; the packages are: core, user" in capsys.readouterr().err


def test_real_tree_static_check_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # Other packages change concurrently, so only the tool's own behaviour is asserted here:
    # it finds every package and reports a verdict instead of crashing. CI runs the full check.
    root = Path(__file__).resolve().parents[2]
    rc = check_packages.main(["--static-only", "--root", str(root)])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    for pkg in load_packages(root):
        assert f"shardkit-{pkg.name} " in out


@pytest.mark.skipif(shutil.which("true") is None, reason="needs a POSIX system")
def test_dynamic_install_alone(
    repo: Path, make_package: MakePackage, capsys: pytest.CaptureFixture[str]
) -> None:
    # One small fake package: wheel built, installed alone into a fresh venv with torch exposed
    # through symlinks, every module imported there; `other` (not declared) must be invisible.
    make_package("other")
    make_package(
        "solo",
        modules={
            "_m.py": "import torch\n\nX = torch.ones(2).sum().item()\n",
            "public.py": "from ._m import X\n\n__all__ = ['X']\n",
            "sub/__init__.py": "from .. import public\n",
        },
    )
    # An optional group: its requirements carry an `extra` marker in the wheel and still match.
    pyproject = repo / "packages/solo/pyproject.toml"
    pyproject.write_text(
        pyproject.read_text() + '\n[project.optional-dependencies]\nfast = ["torch>=2.5"]\n'
    )
    rc = check_packages.main(
        ["--root", str(repo), "--package", "solo", "--work-dir", str(repo / "work")]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert _row(out, "solo")[:5] == ["shardkit-solo", "0.1.0", "-", "ok", "ok"]
    site = next((repo / "work/venvs/solo/venv").rglob("site-packages"))
    installed = sorted(p.name for p in site.iterdir() if p.name.startswith("shardkit"))
    assert installed == ["shardkit", "shardkit_solo-0.1.0.dist-info"]
    assert sorted(p.name for p in (site / "shardkit").iterdir()) == ["solo"]
    assert (site / "shardkit_solo-0.1.0.dist-info/licenses/LICENSE").is_file()
    sdist = next((repo / "work/venvs/solo/sdist").glob("*.tar.gz"))
    assert check_packages.check_sdist(load_packages(repo)[-1], sdist, "0.1.0") == []
    host = repo / "work/venvs/solo/host"
    assert (host / "torch").is_symlink()
    assert not any(p.name.startswith(("shardkit", "pytest", "hypothesis")) for p in host.iterdir())

    # The same venv machinery reports an import failure of the installed package.
    (repo / "packages/solo/src/shardkit/solo/_m.py").write_text("raise RuntimeError('boom')\n")
    rc = check_packages.main(["--root", str(repo), "--package", "solo"])
    out = capsys.readouterr().out
    assert rc == 1
    assert _row(out, "solo")[:5] == ["shardkit-solo", "0.1.0", "-", "ok", "FAIL"]
    assert "import shardkit.solo._m failed" in out
    assert "RuntimeError: boom" in out

    # A wheel and an sdist that lack the license file fail.
    (repo / "packages/solo/src/shardkit/solo/_m.py").write_text("X = 1\n")
    pyproject.write_text(pyproject.read_text().replace('license-files = ["LICENSE"]\n', ""))
    (repo / "packages/solo/LICENSE").unlink()
    rc = check_packages.main(["--root", str(repo), "--package", "solo"])
    out = capsys.readouterr().out
    assert rc == 1
    assert _row(out, "solo")[:5] == ["shardkit-solo", "0.1.0", "-", "FAIL", "FAIL"]
    assert "wheel shardkit_solo-0.1.0-py3-none-any.whl declares no License-File" in out
    assert "sdist shardkit_solo-0.1.0.tar.gz declares no License-File" in out
