"""The README's install command, as documented: one ``pip install`` of package folders from a
clone, each package listed with the folders of the siblings it depends on.

* The README's table (which folders to list for each package) must equal each package and its
  declared sibling closure (``tools/_monorepo.dependency_closure``), and the command shown above
  the table must be one of its rows.
* That command runs in a fresh virtual environment: the exact folders of the README, from the
  repository root. torch (and NumPy) come from this environment through the same folder of
  symlinks ``tools/check_packages.py`` uses ([Note: host torch through symlinks]), so nothing is
  downloaded; the test adds ``--no-index`` (a sibling missing from the command line then fails
  instead of being looked up on an index) and ``--no-build-isolation`` with hatchling linked in
  the same way (no build environment to download). Then every listed package imports from the
  venv, at the version of its ``__about__.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from _tools import ROOT, check_packages_tool

_ROOT = ROOT
_TIMEOUT_S = 300
_ROW = re.compile(r"^\| shardkit-(?P<name>[a-z]+) \| `(?P<folders>[^`]+)` \|$", re.MULTILINE)


_tool = check_packages_tool


def _install_section() -> str:
    text = (_ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Install\n")
    return text[start : text.index("\n## ", start + 1)]


def _table() -> dict[str, list[str]]:
    return {m["name"]: m["folders"].split() for m in _ROW.finditer(_install_section())}


def _documented_command() -> list[str]:
    found = re.search(r"^pip install (\./packages/.+)$", _install_section(), re.MULTILINE)
    assert found, "README.md's Install section shows no `pip install ./packages/...` command"
    return shlex.split(found.group(1))


def test_readme_install_table_lists_every_sibling() -> None:
    tool = _tool()
    packages = tool.load_packages(_ROOT)
    graph = {p.name: p.sibling_names() for p in packages}
    table = _table()
    assert sorted(table) == sorted(graph), (
        f"README.md's install table has rows for {sorted(table)}, the packages are {sorted(graph)}"
    )
    for name, folders in table.items():
        want = {f"./packages/{n}" for n in [name, *tool.dependency_closure(name, graph)]}
        assert folders[0] == f"./packages/{name}", f"row {name}: list the package first: {folders}"
        assert set(folders) == want and len(folders) == len(want), (
            f"README.md install row for shardkit-{name} lists {folders}; it needs exactly "
            f"{sorted(want)} (the package and its declared siblings)"
        )
    command = _documented_command()
    assert command in table.values(), f"the command {command} is not a row of the table"


@pytest.mark.slow
def test_documented_command_installs_in_a_fresh_venv(tmp_path: Path) -> None:
    tool = _tool()
    folders = _documented_command()
    packages = {p.name: p for p in tool.load_packages(_ROOT)}
    names = [f.rsplit("/", 1)[-1] for f in folders]
    third_party = ["torch", "hatchling"]
    for name in names:
        third_party += [
            r.raw for r in packages[name].dependencies() if not r.key.startswith("shardkit-")
        ]
    dists, problems = tool.host_distributions(third_party)
    assert not problems, problems

    venv = tmp_path / "venv"
    proc = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    site, python = tool._venv_paths(venv)
    tool.link_distributions(dists, tmp_path / "host")
    site.mkdir(parents=True, exist_ok=True)
    (site / "_shardkit_check_host.pth").write_text(f"{tmp_path / 'host'}\n", encoding="utf-8")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_FIND_LINKS")}
    env["PIP_CONFIG_FILE"] = os.devnull  # this machine's pip settings are not the reader's
    cmd = [
        sys.executable, "-m", "pip", "--python", str(python), "install",
        "--no-index", "--no-build-isolation", "--no-cache-dir", "--no-input", "--quiet",
        *folders,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    assert proc.returncode == 0, (
        f"the README's install command failed in a fresh venv:\n$ {' '.join(cmd)}\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )

    check = (
        "import importlib, importlib.metadata as md, os, sys\n"
        "for name in sys.argv[2:]:\n"
        "    mod = importlib.import_module('shardkit.' + name)\n"
        "    where = os.path.realpath(mod.__file__)\n"
        "    assert where.startswith(os.path.realpath(sys.argv[1])), (name, where)\n"
        "    print(name, md.version('shardkit-' + name))\n"
    )
    proc = subprocess.run(
        [str(python), "-I", "-c", check, str(site), *names],
        cwd=tmp_path, capture_output=True, text=True, timeout=_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, f"import after install failed:\n{proc.stdout}\n{proc.stderr}"
    for name in names:
        version = tool.read_about_version(packages[name].about_path)
        assert f"{name} {version}" in proc.stdout, (name, version, proc.stdout)
