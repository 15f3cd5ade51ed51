"""Install only what you need: every package's wheel installed ALONE in a fresh virtual
environment (only its declared sibling wheels and torch's dependency closure; no NumPy, no
other shardkit package) runs ``smoke/<package>.py``, a smoke test of its own public API.

The environments are made by ``tools/check_packages.py`` (the foundation's package check: wheel
build, wheel checks, install with ``--no-index``, import of every module, undeclared siblings
not importable); this suite then runs the package's smoke script with that environment's Python,
isolated (``-I``), from an empty directory.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _tools import ROOT, check_packages_tool

_ROOT = ROOT
_SMOKE = Path(__file__).resolve().parent / "smoke"
_SMOKE_TIMEOUT_S = 240


_tool = check_packages_tool


def _package_names() -> list[str]:
    return sorted(
        p.name for p in (_ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()
    )


# Known failures, routed to their owners; strict, so each mark must go once its bug is fixed.
_KNOWN: dict[str, str] = {}


def _params() -> list[Any]:
    return [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_KNOWN[n]))
        if n in _KNOWN
        else n
        for n in _package_names()
    ]


def test_every_package_has_a_smoke_script() -> None:
    scripts = sorted(p.stem for p in _SMOKE.glob("*.py"))
    assert scripts == _package_names(), (
        f"tests-integration/smoke/ has scripts for {scripts} but the packages are "
        f"{_package_names()}: add (or remove) smoke/<package>.py"
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every package's wheel, built once for the module (as the tool builds them)."""
    tool = _tool()
    packages = tool.load_packages(_ROOT)
    work = tmp_path_factory.mktemp("install-alone")
    wheels = tool.build_wheels(packages, work / "wheels")
    return {"tool": tool, "packages": {p.name: p for p in packages}, "wheels": wheels, "work": work}


@pytest.mark.slow
@pytest.mark.parametrize("name", _params())
def test_package_installed_alone_runs_its_smoke_test(name: str, built: dict[str, Any]) -> None:
    tool, packages, work = built["tool"], built["packages"], built["work"] / "venvs"
    pkg = packages[name]
    version = tool.read_about_version(pkg.about_path)
    problems = tool.dynamic_check(pkg, version, built["wheels"], packages, work)
    assert not problems, f"shardkit-{name} installed alone:\n" + "\n".join(problems)

    # dynamic_check leaves the environment it made at <work>/<package>/venv.
    venv = work / name / "venv"
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    assert python.exists(), f"no venv Python at {python}: did tools/check_packages.py move it?"
    run_dir = work / name / "smoke-cwd"
    run_dir.mkdir(exist_ok=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
    }
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [str(python), "-I", str(_SMOKE / f"{name}.py")],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=_SMOKE_TIMEOUT_S,
    )  # fmt: skip
    output = f"--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"smoke/{name}.py failed in shardkit-{name}'s own venv\n{output}"
    assert f"smoke ok: shardkit-{name}" in proc.stdout, output
