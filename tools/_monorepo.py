"""The shardkit monorepo as the tools see it: packages, versions, declared dependencies.

A package is a folder `packages/<name>/` with a `pyproject.toml` whose distribution is
`shardkit-<name>`, importable as `shardkit.<name>` from `src/shardkit/<name>/`.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _versions import InvalidRequirement, Requirement, canonical_name, parse_requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError as exc:
        raise SystemExit(
            "the shardkit tools need Python 3.11+ (tomllib) or the 'tomli' package on 3.10: "
            "pip install tomli"
        ) from exc

__all__ = [
    "DIST_PREFIX",
    "Package",
    "ToolError",
    "atomic_write",
    "changelog_has_version",
    "default_root",
    "dependency_closure",
    "find_package",
    "first_release_pending",
    "load_package",
    "load_packages",
    "load_toml",
    "read_about_version",
    "tomllib",
]

DIST_PREFIX = "shardkit-"


class ToolError(Exception):
    """A problem the user must fix (bad arguments, unreadable files); exit status 2."""


def default_root() -> Path:
    """The repository root: the parent of the `tools/` folder holding this file."""
    return Path(__file__).resolve().parent.parent


def load_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file, raising `ToolError` naming the file and the parse error."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ToolError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ToolError(f"{path} is not valid TOML: {exc}") from None


def read_about_version(path: Path) -> str:
    """The string assigned to `__version__` in `path` (an `__about__.py`), read with `ast`."""
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ToolError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise ToolError(f"{path} has a syntax error: {exc}") from None
    found: list[str] = []
    for node in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        for target in targets:
            if isinstance(target, ast.Name) and target.id == "__version__":
                if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
                    raise ToolError(
                        f"{path}: __version__ must be a plain string literal "
                        f'(__version__ = "0.1.0"), got {ast.unparse(value) if value else None!r}'
                    )
                found.append(value.value)
    if len(found) != 1:
        raise ToolError(
            f'{path}: expected exactly one `__version__ = "X.Y.Z"` assignment, found {len(found)}'
        )
    return found[0]


def changelog_has_version(text: str, version: str) -> bool:
    """Whether a Markdown heading of the changelog names `version` (`## 0.2.0 (2024-05-01)`)."""
    pattern = rf"^#{{1,6}}\s+\[?v?{re.escape(version)}\]?(?=$|[\s(:,])"
    return re.search(pattern, text, flags=re.MULTILINE) is not None


_RELEASE_HEADING_RE = re.compile(r"^#{1,6}\s+\[?v?\d+\.\d+", re.MULTILINE)
_UNRELEASED_ENTRY_RE = re.compile(
    r"^#{1,6}\s+\[?Unreleased\]?\s*$(?P<body>.*?)(?=^#{1,2}\s|\Z)",
    re.IGNORECASE | re.MULTILINE | re.DOTALL,
)


def first_release_pending(text: str) -> bool:
    """Whether a changelog belongs to a package never released yet: no version heading at all,
    and entries (``- ...``) under ``## [Unreleased]``. Its first release writes the heading of the
    version in ``__about__.py`` (``python tools/release.py <package> <that version>``)."""
    if _RELEASE_HEADING_RE.search(text):
        return False
    found = _UNRELEASED_ENTRY_RE.search(text)
    return found is not None and re.search(r"^\s*[-*] \S", found["body"], re.MULTILINE) is not None


@dataclass(frozen=True)
class Package:
    """One distribution of the monorepo.

    Attributes:
        name: The folder name and import name under `shardkit.` (`optim`).
        path: `packages/<name>/`.
        pyproject: The parsed `pyproject.toml`.
    """

    name: str
    path: Path
    pyproject: Mapping[str, Any]

    @property
    def project(self) -> Mapping[str, Any]:
        """The `[project]` table (empty if missing)."""
        table = self.pyproject.get("project", {})
        return table if isinstance(table, Mapping) else {}

    @property
    def dist_name(self) -> str:
        """The distribution name expected for the folder: `shardkit-<name>`."""
        return DIST_PREFIX + self.name

    @property
    def src_dir(self) -> Path:
        """`src/shardkit/<name>/`."""
        return self.path / "src" / "shardkit" / self.name

    @property
    def about_path(self) -> Path:
        """`src/shardkit/<name>/__about__.py`."""
        return self.src_dir / "__about__.py"

    @property
    def pyproject_path(self) -> Path:
        """`packages/<name>/pyproject.toml`."""
        return self.path / "pyproject.toml"

    @property
    def changelog_path(self) -> Path:
        """`packages/<name>/CHANGELOG.md`."""
        return self.path / "CHANGELOG.md"

    def version(self) -> str:
        """The version in `__about__.py` (raises `ToolError` if unreadable)."""
        return read_about_version(self.about_path)

    def requirement_strings(self) -> list[tuple[str, str]]:
        """`(where, requirement)` for `[project].dependencies` and every optional group."""
        out: list[tuple[str, str]] = []
        deps = self.project.get("dependencies", [])
        if isinstance(deps, list):
            out.extend(("dependencies", d) for d in deps)
        optional = self.project.get("optional-dependencies", {})
        if isinstance(optional, Mapping):
            for group, reqs in optional.items():
                if isinstance(reqs, list):
                    out.extend((f"optional-dependencies.{group}", r) for r in reqs)
        return out

    def dependencies(self) -> list[Requirement]:
        """Parsed `[project].dependencies` (raises `ToolError` naming a bad entry)."""
        deps = self.project.get("dependencies", [])
        if not isinstance(deps, list):
            raise ToolError(
                f"{self.pyproject_path}: [project].dependencies must be a list of strings, "
                f"got {type(deps).__name__}"
            )
        out = []
        for d in deps:
            try:
                out.append(parse_requirement(d))
            except InvalidRequirement as exc:
                raise ToolError(f"{self.pyproject_path}: bad dependency {exc}") from None
        return out

    def sibling_dependencies(self) -> list[Requirement]:
        """Declared dependencies on other `shardkit-*` distributions."""
        return [r for r in self.dependencies() if r.key.startswith(DIST_PREFIX)]

    def sibling_names(self) -> list[str]:
        """Folder names of the declared sibling dependencies (`["buckets", "partition"]`)."""
        return [r.key[len(DIST_PREFIX) :] for r in self.sibling_dependencies()]


def load_package(path: Path) -> Package:
    """Load `packages/<name>/`; raises `ToolError` if its pyproject.toml is missing or invalid."""
    pyproject = path / "pyproject.toml"
    if not pyproject.is_file():
        raise ToolError(f"{path} has no pyproject.toml; every folder under packages/ is a package")
    return Package(name=path.name, path=path, pyproject=load_toml(pyproject))


def load_packages(root: Path) -> list[Package]:
    """Every package under `root/packages/`, sorted by name."""
    packages_dir = root / "packages"
    if not packages_dir.is_dir():
        raise ToolError(
            f"{root} has no packages/ folder; pass --root pointing at the shardkit repository"
        )
    dirs = sorted(
        p for p in packages_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
    )
    return [load_package(p) for p in dirs]


def find_package(packages: Iterable[Package], spec: str) -> Package:
    """The package named `spec` (`optim`, `shardkit-optim` or `packages/optim`)."""
    packages = list(packages)
    key = canonical_name(spec.rstrip("/").rsplit("/", 1)[-1])
    if key.startswith(DIST_PREFIX):
        key = key[len(DIST_PREFIX) :]
    for pkg in packages:
        if canonical_name(pkg.name) == key:
            return pkg
    names = ", ".join(p.name for p in packages) or "(none)"
    raise ToolError(f"unknown package {spec!r}; the packages are: {names}")


def dependency_closure(name: str, graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Every sibling reachable from `name` through declared dependencies (excluding `name`)."""
    seen: list[str] = []
    stack = list(graph.get(name, ()))
    while stack:
        dep = stack.pop()
        if dep in seen or dep == name:
            continue
        seen.append(dep)
        stack.extend(graph.get(dep, ()))
    return sorted(seen)


def atomic_write(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (temporary file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
