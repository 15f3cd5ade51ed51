#!/usr/bin/env python3
"""Check that every shardkit package is separately installable and imports only what it declares.

    python tools/check_packages.py [--static-only] [--package NAME ...] [--jobs N] [--root PATH]
        [--work-dir PATH]

Static part (seconds): for every package, every module under `src/shardkit/<name>/` is parsed with
`ast` and each import (module level, in functions, under TYPE_CHECKING, relative ones resolved)
must be the standard library, the package itself, a sibling declared in `[project].dependencies`,
or a third-party distribution declared there (torch included). Layout rules: no
`src/shardkit/__init__.py`, `py.typed`, `__about__.py` with a literal `__version__` that hatchling
reads, sibling dependencies are bounded ranges (never `==` pins) that admit the sibling's current
version, no dependency cycles, README.md and a CHANGELOG.md entry for the current version.
Packaging metadata: a LICENSE file (the repository's text) listed in `[project].license-files`,
per-version `Programming Language :: Python :: 3.N` classifiers that match `requires-python`,
`[project.urls]`, and a README.md without relative links (they are dead on a package index
page: every link must be an absolute URL).

Dynamic part: every wheel and sdist is built (hatchling in-process when importable), checked
(files, metadata, the license file in both) and the wheel is installed ALONE into a fresh virtual
environment with `--no-index` so that only the declared sibling wheels can be pulled in. torch, its own dependencies and the package's declared
third-party dependencies come from the current environment through a folder of symlinks added by a
`.pth` file (pip sees their dist-info as installed; nothing else of this environment is visible).
Then every module of the package is imported there, and undeclared siblings must not be
importable. Exit status: 0 all good, 1 a check failed, 2 bad usage or environment.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import email.parser
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import textwrap
import time
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _imports import collect_imports, iter_modules, module_name
from _monorepo import (
    DIST_PREFIX,
    Package,
    ToolError,
    changelog_has_version,
    default_root,
    dependency_closure,
    find_package,
    first_release_pending,
    load_packages,
    read_about_version,
)
from _versions import (
    HAVE_PACKAGING,
    InvalidRequirement,
    InvalidVersion,
    Requirement,
    Version,
    canonical_name,
    parse_requirement,
    specs_admit,
)

__all__ = [
    "REPO_URL",
    "Result",
    "build_sdist",
    "check_sdist",
    "check_wheel",
    "dynamic_check",
    "main",
    "readme_link_problems",
    "static_check",
]

_STDLIB = frozenset(sys.stdlib_module_names)
_SUBPROCESS_TIMEOUT = 300


@dataclass
class Result:
    """Outcome for one package.

    Attributes:
        name: Package folder name.
        version: Version from `__about__.py` (`?` if unreadable).
        deps: Declared sibling folder names.
        static: Problems found by the static check.
        dynamic: Problems found by the dynamic check (None: not run).
        seconds: Wall time spent on this package.
    """

    name: str
    version: str = "?"
    deps: list[str] = field(default_factory=list)
    static: list[str] = field(default_factory=list)
    dynamic: list[str] | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.static and not self.dynamic


# --------------------------------------------------------------------------------------------
# Static checks


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _check_layout(pkg: Package, root: Path, result: Result) -> None:
    problems = result.static
    project = pkg.project
    if not project:
        problems.append("pyproject.toml has no [project] table")
        return
    name = project.get("name")
    if not isinstance(name, str) or canonical_name(name) != pkg.dist_name:
        problems.append(
            f"[project].name is {name!r}; a package in packages/{pkg.name}/ must be named "
            f"{pkg.dist_name!r}"
        )
    src_ns = pkg.path / "src" / "shardkit"
    if (src_ns / "__init__.py").exists():
        problems.append(
            f"{_rel(src_ns / '__init__.py', root)} exists; shardkit is a PEP 420 namespace shared "
            "by all packages: delete it"
        )
    if not (pkg.src_dir / "__init__.py").is_file():
        problems.append(f"{_rel(pkg.src_dir / '__init__.py', root)} is missing")
    if not (pkg.src_dir / "py.typed").is_file():
        problems.append(f"{_rel(pkg.src_dir / 'py.typed', root)} is missing (PEP 561 marker)")
    for doc in ("README.md", "CHANGELOG.md"):
        if not (pkg.path / doc).is_file():
            problems.append(f"packages/{pkg.name}/{doc} is missing")
    _check_license(pkg, root, problems)
    _check_classifiers(project, problems)
    if not isinstance(project.get("urls"), Mapping) or not project["urls"]:
        problems.append(
            "[project.urls] is missing: add Homepage, Documentation, Repository, Changelog and "
            f"Issues links ({REPO_URL}/...)"
        )
    readme = pkg.path / "README.md"
    if readme.is_file():
        problems.extend(
            f"packages/{pkg.name}/{problem}" for problem in readme_link_problems(readme, root)
        )

    version: str | None = None
    try:
        version = read_about_version(pkg.about_path)
        Version.parse(version)
        result.version = version
    except (ToolError, InvalidVersion) as exc:
        problems.append(str(exc))
        version = None
    if version is None:
        return

    hatch_version = pkg.pyproject.get("tool", {}).get("hatch", {}).get("version", {})
    about_rel = f"src/shardkit/{pkg.name}/__about__.py"
    dynamic = project.get("dynamic", [])
    if "version" in project:
        if "version" in dynamic:
            problems.append("[project] has both a static version and 'version' in dynamic")
        elif str(project["version"]) != version:
            problems.append(
                f"[project].version is {project['version']!r} but __about__.py says {version!r}; "
                'hatchling would build the wrong version: use dynamic = ["version"]'
            )
    elif "version" not in dynamic:
        problems.append("[project] has no version and 'version' is not in [project].dynamic")
    elif not isinstance(hatch_version, dict) or (
        Path(str(hatch_version.get("path", ""))).as_posix() != about_rel
    ):
        problems.append(
            f"[tool.hatch.version].path is {hatch_version.get('path') if isinstance(hatch_version, dict) else None!r}; "
            f"it must be {about_rel!r} so that hatchling reads the version tools/release.py bumps"
        )

    changelog = pkg.changelog_path
    text = changelog.read_text(encoding="utf-8") if changelog.is_file() else None
    if (
        text is not None
        and not changelog_has_version(text, version)
        and not first_release_pending(text)  # a new package: its entries wait under Unreleased
    ):
        problems.append(
            f"CHANGELOG.md has no heading for the current version {version} "
            f'(python tools/release.py writes one: "## [{version}] - YYYY-MM-DD"; a package '
            f"never released lists its changes under '## [Unreleased]' until its first release)"
        )


REPO_URL = "https://github.com/shardkit/shardkit"
"""Where relative README links point to once absolute (`<REPO_URL>/blob/main/<path>`)."""

_LINK_RES = (
    re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)"),  # [text](url "title")
    re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s|$)"),  # [ref]: url
    re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']"""),  # HTML
)
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_CODE_SPAN_RE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def readme_link_problems(readme: Path, root: Path) -> list[str]:
    """Relative links in a Markdown README (dead on a package index page), one message each.

    Links inside fenced code blocks and code spans are ignored, as are in-page anchors (`#x`)
    and links with a scheme (`https:`, `mailto:`). Each message names the line and suggests the
    absolute URL of the target in this repository.
    """
    problems: list[str] = []
    fence: str | None = None
    for lineno, line in enumerate(readme.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            marker = stripped[:3]
            fence = marker if fence is None else (None if marker == fence else fence)
            continue
        if fence is not None:
            continue
        text = _CODE_SPAN_RE.sub("", line)
        for pattern in _LINK_RES:
            for match in pattern.finditer(text):
                target = match.group(1)
                if target.startswith("#") or _SCHEME_RE.match(target) or target.startswith("//"):
                    continue
                path, _, anchor = target.partition("#")
                resolved = (readme.parent / path).resolve()
                try:
                    rel = resolved.relative_to(root.resolve()).as_posix()
                except ValueError:
                    rel = path
                kind = "tree" if resolved.is_dir() else "blob"
                url = f"{REPO_URL}/{kind}/main/{rel}" + (f"#{anchor}" if anchor else "")
                problems.append(
                    f"README.md:{lineno}: relative link {target!r} is dead on a package index "
                    f"page; use the absolute URL {url}"
                )
    return problems


def _check_license(pkg: Package, root: Path, problems: list[str]) -> None:
    """LICENSE present, equal to the repository's, and listed in `[project].license-files`."""
    project = pkg.project
    here = pkg.path / "LICENSE"
    if not here.is_file():
        problems.append(
            f"packages/{pkg.name}/LICENSE is missing: copy the repository's LICENSE there "
            "(the wheel and sdist must ship the license text)"
        )
    elif (root / "LICENSE").is_file() and here.read_bytes() != (root / "LICENSE").read_bytes():
        problems.append(
            f"packages/{pkg.name}/LICENSE differs from the repository's LICENSE: copy it again"
        )
    files = project.get("license-files")
    if not isinstance(files, list) or not any(
        isinstance(f, str) and Path(f).name.startswith("LICENSE") for f in files
    ):
        problems.append(
            f'[project].license-files is {files!r}: set license-files = ["LICENSE"] so that '
            "hatchling ships the license text in the wheel (.dist-info/licenses/) and the sdist"
        )


_PY_CLASSIFIER_RE = re.compile(r"^Programming Language :: Python :: (3\.\d+)$")


def _check_classifiers(project: Mapping[str, object], problems: list[str]) -> None:
    """Per-version Python classifiers exist, all admitted by `requires-python`, lowest included."""
    classifiers = project.get("classifiers", [])
    versions = [
        m.group(1)
        for c in (classifiers if isinstance(classifiers, list) else [])
        if isinstance(c, str)
        for m in [_PY_CLASSIFIER_RE.match(c)]
        if m
    ]
    requires = project.get("requires-python")
    if not isinstance(requires, str) or not requires.strip():
        problems.append('[project].requires-python is missing (e.g. ">=3.10")')
        return
    if not versions:
        problems.append(
            "[project].classifiers names no Python version: add "
            "'Programming Language :: Python :: 3.N' for each version requires-python admits"
        )
        return
    try:
        specs = parse_requirement(f"python{requires}").specs
    except InvalidRequirement as exc:
        problems.append(f"[project].requires-python {requires!r} is invalid: {exc}")
        return
    refused = [v for v in versions if not specs_admit(specs, v)]
    if refused:
        problems.append(
            f"classifiers name Python {', '.join(refused)}, which requires-python {requires!r} "
            "excludes: remove them or widen requires-python"
        )
    lowest = next((v for op, v in specs if op == ">="), None)
    if lowest is not None and ".".join(lowest.split(".")[:2]) not in versions:
        problems.append(
            f"requires-python is {requires!r} but no 'Programming Language :: Python :: "
            f"{'.'.join(lowest.split('.')[:2])}' classifier says so: add it"
        )


def _check_dependencies(
    pkg: Package, packages: Mapping[str, Package], versions: Mapping[str, str], result: Result
) -> list[Requirement]:
    problems = result.static
    reqs: list[Requirement] = []
    for where, raw in pkg.requirement_strings():
        try:
            req = parse_requirement(raw)
        except InvalidRequirement as exc:
            problems.append(f"[project.{where}]: bad requirement {exc}")
            continue
        if where == "dependencies":
            reqs.append(req)
        if not req.key.startswith(DIST_PREFIX):
            continue
        sib = req.key[len(DIST_PREFIX) :]
        label = f"[project.{where}] {raw!r}"
        if sib == pkg.name:
            problems.append(f"{label}: a package cannot depend on itself")
            continue
        if sib not in packages:
            problems.append(f"{label}: there is no packages/{sib}/ in this repository")
            continue
        if req.url is not None:
            problems.append(f"{label}: siblings must be required by version range, not by URL")
            continue
        ops = [op for op, v in req.specs]
        if "===" in ops or any(op == "==" and not v.endswith(".*") for op, v in req.specs):
            problems.append(
                f"{label}: exact pin; siblings depend on each other by ranges such as "
                f"'{req.name}>=0.1,<0.2'"
            )
            continue
        has_lower = any(op in (">=", ">", "~=") or op == "==" for op in ops)
        has_upper = any(op in ("<", "<=", "~=") or op == "==" for op in ops)
        if not (has_lower and has_upper):
            problems.append(
                f"{label}: unbounded range; give both bounds, e.g. '{req.name}>=0.1,<0.2'"
            )
            continue
        sib_version = versions.get(sib)
        if sib_version is not None and not specs_admit(req.specs, sib_version):
            problems.append(
                f"{label}: does not admit the current {req.key} {sib_version}; widen the range "
                f"(python tools/release.py {sib} ... --update-dependents does it)"
            )
    result.deps = sorted(r.key[len(DIST_PREFIX) :] for r in reqs if r.key.startswith(DIST_PREFIX))
    return reqs


def _module_distributions() -> dict[str, list[str]]:
    try:
        return {k: list(v) for k, v in importlib.metadata.packages_distributions().items()}
    except Exception:  # pragma: no cover - broken metadata in the environment
        return {}


def _check_imports(
    pkg: Package,
    root: Path,
    reqs: Sequence[Requirement],
    packages: Mapping[str, Package],
    module_dists: Mapping[str, Sequence[str]],
    result: Result,
) -> None:
    declared = {r.key for r in reqs}
    src_root = pkg.path / "src"
    if not pkg.src_dir.is_dir():
        result.static.append(f"{_rel(pkg.src_dir, root)} does not exist")
        return
    for path in iter_modules(pkg.src_dir):
        rel = _rel(path, root)
        modname = module_name(path, src_root)
        try:
            refs = collect_imports(
                path.read_text(encoding="utf-8"), modname, path.name == "__init__.py", rel
            )
        except SyntaxError as exc:
            result.static.append(f"{rel}:{exc.lineno}: syntax error: {exc.msg}")
            continue
        for ref in refs:
            where = f"{rel}:{ref.line}"
            if ref.error is not None:
                result.static.append(f"{where}: {ref.error}")
                continue
            parts = ref.module.split(".")
            top = parts[0]
            if top == "shardkit":
                if len(parts) < 2 or parts[1] == pkg.name:
                    continue
                sib = parts[1]
                if sib not in packages:
                    result.static.append(
                        f"{where}: imports {ref.module!r}, but there is no package "
                        f"shardkit-{sib} in this repository"
                    )
                elif DIST_PREFIX + sib not in declared:
                    result.static.append(
                        f"{where}: imports {ref.module!r} but shardkit-{sib} is not in "
                        f"[project].dependencies; declare 'shardkit-{sib}>=X.Y,<X.Z' or remove "
                        "the import"
                    )
                continue
            if top in _STDLIB or not top:
                continue
            providers = {canonical_name(d) for d in module_dists.get(top, ())}
            if providers & declared or canonical_name(top) in declared:
                continue
            who = ", ".join(sorted(providers)) or "a distribution not installed here"
            result.static.append(
                f"{where}: imports {ref.module!r} (from {who}), which is neither the standard "
                "library nor declared in [project].dependencies; declare it or remove the import"
            )


def _find_cycles(graph: Mapping[str, Sequence[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep in graph and state.get(dep) is None:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if state.get(node) is None:
            visit(node)
    return cycles


def static_check(
    packages: Sequence[Package], root: Path, only: Iterable[str] | None = None
) -> dict[str, Result]:
    """Run the static checks on `only` (default: all packages); returns results by name."""
    by_name = {p.name: p for p in packages}
    versions: dict[str, str] = {}
    for p in packages:
        try:
            versions[p.name] = read_about_version(p.about_path)
        except ToolError:
            pass
    module_dists = _module_distributions()
    wanted = set(only) if only is not None else set(by_name)
    results: dict[str, Result] = {}
    graph: dict[str, list[str]] = {}
    for pkg in packages:
        result = Result(pkg.name)
        start = time.perf_counter()
        _check_layout(pkg, root, result)
        reqs = _check_dependencies(pkg, by_name, versions, result)
        graph[pkg.name] = result.deps
        if pkg.name in wanted:
            _check_imports(pkg, root, reqs, by_name, module_dists, result)
            result.seconds = time.perf_counter() - start
            results[pkg.name] = result
    for cycle in _find_cycles(graph):
        text = " -> ".join(DIST_PREFIX + n for n in cycle)
        for name in set(cycle):
            if name in results:
                results[name].static.append(f"dependency cycle: {text}")
    return results


# --------------------------------------------------------------------------------------------
# Dynamic checks


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PIP_")
        and k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run(cmd: Sequence[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(cmd),
            cwd=cwd,
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=_SUBPROCESS_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(
            list(cmd), 124, "", f"timed out after {exc.timeout:.0f}s: {' '.join(cmd)}"
        )


def _tail(text: str, lines: int = 25) -> str:
    return textwrap.indent("\n".join(text.strip().splitlines()[-lines:]), "    | ")


_BUILD_SCRIPT = """
import os, sys, traceback
from hatchling.build import build_wheel
out = sys.argv[1]
for d in sys.argv[2:]:
    os.chdir(d)
    try:
        print("OK\\t" + d + "\\t" + build_wheel(out), flush=True)
    except BaseException:
        print("ERR\\t" + d + "\\t" + traceback.format_exc().replace("\\n", "\\\\n"), flush=True)
"""


def _buildable_in_process(pkg: Package) -> bool:
    """Whether this environment satisfies the package's [build-system] (hatchling backend)."""
    build_system = pkg.pyproject.get("build-system", {})
    if not isinstance(build_system, Mapping):
        return False
    if build_system.get("build-backend") != "hatchling.build":
        return False
    for raw in build_system.get("requires", []):
        try:
            req = parse_requirement(raw)
            installed = importlib.metadata.version(req.name)
        except (InvalidRequirement, importlib.metadata.PackageNotFoundError):
            return False
        if req.marker is None and req.specs and not specs_admit(req.specs, installed):
            return False
    return True


def build_wheels(packages: Sequence[Package], out: Path) -> dict[str, Path | str]:
    """Build each package's wheel into `out`; maps name -> wheel path, or an error message.

    Packages whose [build-system] this environment satisfies (hatchling importable, in range)
    are built through the backend's PEP 517 hook without isolation, all in one process; the
    others with `pip wheel` in an isolated build environment (which needs the index).
    """
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Path | str] = {}
    fast = [p for p in packages if _buildable_in_process(p)]
    if fast:
        dirs = {str(p.path.resolve()): p.name for p in fast}
        proc = _run([sys.executable, "-c", _BUILD_SCRIPT, str(out), *dirs])
        for line in proc.stdout.splitlines():
            status, d, payload = [*line.split("\t", 2), "", ""][:3]
            if d in dirs:
                results[dirs[d]] = (
                    out / payload
                    if status == "OK"
                    else "wheel build failed:\n" + _tail(payload.replace("\\n", "\n"))
                )
        for name in dirs.values():
            results.setdefault(name, "wheel build failed:\n" + _tail(proc.stderr or proc.stdout))
    for pkg in packages:
        if pkg in fast:
            continue
        before = set(out.glob("*.whl"))
        proc = _run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(pkg.path)]
        )
        new = sorted(set(out.glob("*.whl")) - before)
        results[pkg.name] = (
            new[0]
            if proc.returncode == 0 and new
            else "pip wheel (isolated build) failed:\n" + _tail(proc.stderr or proc.stdout)
        )
    return results


def _req_tuple(req: Requirement) -> tuple[str, tuple[tuple[str, str], ...], str]:
    return (req.key, tuple(sorted(req.specs)), (req.marker or "").replace(" ", ""))


def _source_files(src_dir: Path) -> list[str]:
    """Files the wheel must ship: everything under `src_dir` but caches and hidden files."""
    out = []
    for path in sorted(src_dir.rglob("*")):
        rel = path.relative_to(src_dir)
        if not path.is_file() or path.suffix in (".pyc", ".pyo"):
            continue
        if any(
            part.startswith(".") or part == "__pycache__" or part.endswith(".egg-info")
            for part in rel.parts
        ):
            continue
        out.append(rel.as_posix())
    return out


def check_wheel(pkg: Package, wheel: Path, version: str) -> list[str]:
    """Problems with the wheel's contents and metadata (files, name, version, requirements)."""
    problems: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = [n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")]
        meta_name = next((f"{d}/METADATA" for d in dist_info), None)
        meta_text = zf.read(meta_name).decode("utf-8") if meta_name in names else ""
    prefix = f"shardkit/{pkg.name}/"
    strays = [n for n in names if not n.startswith(prefix) and n.split("/", 1)[0] not in dist_info]
    if strays:
        problems.append(
            f"wheel {wheel.name} ships files outside {prefix}: {', '.join(sorted(strays)[:5])}"
        )
    src_files = {prefix + rel for rel in _source_files(pkg.src_dir)}
    missing = sorted(src_files - set(names))
    if missing:
        problems.append(
            f"wheel {wheel.name} lacks {', '.join(missing[:5])} (excluded by the build config "
            "or .gitignore?)"
        )
    if not meta_text:
        return [*problems, f"wheel {wheel.name} has no METADATA"]
    meta = email.parser.Parser().parsestr(meta_text)
    licenses = [
        f"{d}/licenses/{f}" for d in dist_info[:1] for f in meta.get_all("License-File", [])
    ]
    if not licenses:
        problems.append(
            f"wheel {wheel.name} declares no License-File: set [project].license-files "
            '= ["LICENSE"] (hatchling>=1.27)'
        )
    for name in licenses:
        if name not in names:
            problems.append(f"wheel {wheel.name} lacks its license file {name}")
    if canonical_name(meta.get("Name", "")) != pkg.dist_name:
        problems.append(f"wheel metadata Name is {meta.get('Name')!r}, expected {pkg.dist_name!r}")
    if meta.get("Version") != version:
        problems.append(
            f"hatchling built version {meta.get('Version')!r} but __about__.py says {version!r}"
        )
    try:
        everything = [_req_tuple(parse_requirement(r)) for r in meta.get_all("Requires-Dist", [])]
        declared = sorted(_req_tuple(r) for r in pkg.dependencies())
        declared_extras = sorted(
            (key, specs, group)
            for where, text in pkg.requirement_strings()
            if where.startswith("optional-dependencies.")
            for group in [where.split(".", 1)[1]]
            for key, specs, _ in [_req_tuple(parse_requirement(text))]
        )
    except (InvalidRequirement, ToolError) as exc:
        return [*problems, f"cannot compare requirements: {exc}"]
    # Requirements of an optional group carry an `extra == "group"` marker in the wheel.
    built = sorted(r for r in everything if "extra==" not in r[2])
    built_extras = sorted(
        (key, specs, marker.split("extra==", 1)[1].strip("'\""))
        for key, specs, marker in everything
        if "extra==" in marker
    )
    if built != declared:
        problems.append(
            f"wheel Requires-Dist {built} differs from [project].dependencies {declared}"
        )
    if built_extras != declared_extras:
        problems.append(
            f"wheel extras {built_extras} differ from [project].optional-dependencies "
            f"{declared_extras}"
        )
    return problems


_SDIST_SCRIPT = """
import sys
from hatchling.build import build_sdist
print(build_sdist(sys.argv[1]), flush=True)
"""


def build_sdist(pkg: Package, out: Path) -> Path | str:
    """Build `pkg`'s sdist into `out`; its path, or an error message.

    In-process hatchling when this environment satisfies the package's [build-system], else
    `python -m build --sdist` (an isolated build environment, which needs the index).
    """
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.tar.gz"))
    if _buildable_in_process(pkg):
        proc = _run([sys.executable, "-c", _SDIST_SCRIPT, str(out.resolve())], cwd=pkg.path)
        how = "hatchling build_sdist"
    else:
        try:
            importlib.metadata.version("build")
        except importlib.metadata.PackageNotFoundError:
            return "cannot build the sdist: neither hatchling nor build is installed here"
        proc = _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(pkg.path)])
        how = "python -m build --sdist"
    new = sorted(set(out.glob("*.tar.gz")) - before)
    if proc.returncode != 0 or not new:
        return f"sdist build ({how}) failed:\n" + _tail(proc.stderr or proc.stdout)
    return new[0]


def check_sdist(pkg: Package, sdist: Path, version: str) -> list[str]:
    """Problems with the sdist: PKG-INFO name/version, license file(s), README, CHANGELOG."""
    with tarfile.open(sdist, "r:gz") as tf:
        members = {m.name for m in tf.getmembers() if m.isfile()}
        tops = {name.split("/", 1)[0] for name in members}
        top = next(iter(tops)) if len(tops) == 1 else None
        if top is None:
            return [f"sdist {sdist.name} does not unpack into one folder: {sorted(tops)[:5]}"]
        info = tf.extractfile(f"{top}/PKG-INFO") if f"{top}/PKG-INFO" in members else None
        meta_text = info.read().decode("utf-8") if info is not None else ""
    if not meta_text:
        return [f"sdist {sdist.name} has no PKG-INFO"]
    meta = email.parser.Parser().parsestr(meta_text)
    problems: list[str] = []
    if canonical_name(meta.get("Name", "")) != pkg.dist_name or meta.get("Version") != version:
        problems.append(
            f"sdist PKG-INFO says {meta.get('Name')} {meta.get('Version')}, expected "
            f"{pkg.dist_name} {version}"
        )
    licenses = meta.get_all("License-File", [])
    if not licenses:
        problems.append(
            f"sdist {sdist.name} declares no License-File: set [project].license-files "
            '= ["LICENSE"] (hatchling>=1.27)'
        )
    for name in [*licenses, "README.md", "CHANGELOG.md", "pyproject.toml"]:
        if f"{top}/{name}" not in members:
            problems.append(f"sdist {sdist.name} lacks {name}")
    return problems


def _marker_applies(req: Requirement, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    if HAVE_PACKAGING:
        from packaging.markers import Marker

        marker = Marker(req.marker)
        return any(marker.evaluate({"extra": e}) for e in ("", *extras))
    # Without packaging: extras are never requested by torch's closure; other markers are kept
    # (exposing one more installed dependency is harmless).
    return "extra" not in req.marker


def host_distributions(
    requirements: Iterable[str],
) -> tuple[list[importlib.metadata.Distribution], list[str]]:
    """The installed distributions that `requirements` need, transitively, and any problems."""
    found: dict[str, importlib.metadata.Distribution] = {}
    problems: list[str] = []
    stack: list[tuple[str, str]] = [(r, "the package") for r in requirements]
    while stack:
        raw, needed_by = stack.pop()
        try:
            req = parse_requirement(raw)
        except InvalidRequirement as exc:
            problems.append(f"cannot parse {raw!r} required by {needed_by}: {exc}")
            continue
        if not _marker_applies(req, ()) or req.key in found:
            continue
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(
                f"{req.name} (required by {needed_by}) is not installed in this environment; "
                "the dynamic check takes torch and declared third-party dependencies from it"
            )
            continue
        found[req.key] = dist
        for sub in dist.requires or []:
            try:
                sub_req = parse_requirement(sub)
            except InvalidRequirement:
                continue
            if _marker_applies(sub_req, req.extras):
                stack.append((sub, dist.metadata["Name"]))
    return list(found.values()), problems


def link_distributions(dists: Iterable[importlib.metadata.Distribution], target: Path) -> None:
    """Symlink each distribution's top-level files (and its dist-info) into `target`."""
    # [Note: host torch through symlinks]
    # The fresh venv must see torch without seeing the rest of this environment. A folder of
    # symlinks to exactly the files of torch's dependency closure, put on sys.path by a .pth
    # file, gives that: imports resolve through it and pip's installed-distribution scan (it
    # walks sys.path) finds the dist-info folders, so `torch>=2.4` counts as satisfied.
    target.mkdir(parents=True, exist_ok=True)
    for dist in dists:
        base = Path(str(dist.locate_file("")))
        tops: set[str] = set()
        for f in dist.files or []:
            parts = Path(str(f)).parts
            if parts and parts[0] not in ("..", "__pycache__") and not parts[0].endswith(".pth"):
                tops.add(parts[0])
        if not dist.files:
            info = getattr(dist, "_path", None)
            if info is not None:
                tops.add(Path(str(info)).name)
            tops.update((dist.read_text("top_level.txt") or "").split())
        for top in sorted(tops):
            src = base / top
            dst = target / top
            if src.exists() and not os.path.lexists(dst):
                dst.symlink_to(src, target_is_directory=src.is_dir())


_IMPORT_SCRIPT = r"""
import importlib, importlib.metadata, importlib.util, json, os, sys, traceback
args = json.loads(sys.argv[1])
errors = []
site = os.path.realpath(args["site"])
for mod in [args["top"]] + [m for m in args["modules"] if m != args["top"]]:
    try:
        importlib.import_module(mod)
    except BaseException:
        errors.append("import %s failed:\n%s" % (mod, traceback.format_exc(limit=-4)))
        if mod == args["top"]:
            break
top = sys.modules.get(args["top"])
if top is not None:
    where = os.path.realpath(getattr(top, "__file__", "") or "")
    if not where.startswith(site + os.sep):
        errors.append("%s was imported from %s, not from the venv" % (args["top"], where))
try:
    got = importlib.metadata.version(args["dist"])
    if got != args["version"]:
        errors.append("installed %s is %s, expected %s" % (args["dist"], got, args["version"]))
except importlib.metadata.PackageNotFoundError:
    errors.append("%s is not installed in the venv" % args["dist"])
import shardkit
if getattr(shardkit, "__file__", None):
    errors.append("shardkit is a regular package (%s): it must stay a namespace" % shardkit.__file__)
for name in args["forbidden"]:
    if importlib.util.find_spec("shardkit." + name) is not None:
        errors.append("undeclared sibling shardkit.%s is importable" % name)
for name in args["allowed"]:
    if importlib.util.find_spec("shardkit." + name) is None:
        errors.append("declared sibling shardkit.%s is not importable" % name)
print("\n" + json.dumps(errors))
"""


def _venv_paths(venv: Path) -> tuple[Path, Path]:
    scheme = "venv" if "venv" in sysconfig.get_scheme_names() else None
    vars_ = {"base": str(venv), "platbase": str(venv)}
    purelib = (
        sysconfig.get_path("purelib", scheme, vars=vars_)
        if scheme
        else sysconfig.get_path("purelib", vars=vars_)
    )
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    return Path(purelib), python


def dynamic_check(
    pkg: Package,
    version: str,
    wheels: Mapping[str, Path | str],
    packages: Mapping[str, Package],
    work: Path,
    phases: dict[str, float] | None = None,
) -> list[str]:
    """Install `pkg`'s wheel alone into a fresh venv and import every module of it there.

    `phases`, when given, receives the seconds spent in venv creation, pip and the imports.
    """
    phases = {} if phases is None else phases
    wheel = wheels.get(pkg.name)
    if not isinstance(wheel, Path):
        return [wheel or "no wheel was built"]
    problems = check_wheel(pkg, wheel, version)
    t = time.perf_counter()
    sdist = build_sdist(pkg, work / pkg.name / "sdist")
    phases["sdist"] = time.perf_counter() - t
    problems += [sdist] if isinstance(sdist, str) else check_sdist(pkg, sdist, version)
    graph = {name: p.sibling_names() for name, p in packages.items()}
    allowed = dependency_closure(pkg.name, graph)
    for dep in allowed:
        if not isinstance(wheels.get(dep), Path):
            problems.append(f"the wheel of sibling {dep} could not be built")
    if problems:
        return problems

    third_party = ["torch"]
    for name in [pkg.name, *allowed]:
        third_party += [
            r.raw for r in packages[name].dependencies() if not r.key.startswith(DIST_PREFIX)
        ]
    dists, host_problems = host_distributions(third_party)
    if host_problems:
        return host_problems

    base = work / pkg.name
    venv = base / "venv"
    t = time.perf_counter()
    proc = _run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)])
    if proc.returncode != 0:
        return ["python -m venv failed:\n" + _tail(proc.stderr or proc.stdout)]
    site, python = _venv_paths(venv)
    host = base / "host"
    link_distributions(dists, host)
    site.mkdir(parents=True, exist_ok=True)
    (site / "_shardkit_check_host.pth").write_text(f"{host}\n", encoding="utf-8")
    phases["venv"] = time.perf_counter() - t
    t = time.perf_counter()

    proc = _run(
        [
            sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
            "--find-links", str(wheel.parent), "--no-cache-dir", "--no-input",
            "--no-warn-script-location", "--quiet", str(wheel),
        ]
    )  # fmt: skip
    phases["pip"] = time.perf_counter() - t
    if proc.returncode != 0:
        return [
            f"pip install {wheel.name} into a fresh venv (no index; sibling wheels only) failed:\n"
            + _tail(proc.stderr or proc.stdout)
        ]
    modules = [
        module_name(p, pkg.path / "src") for p in iter_modules(pkg.src_dir) if p.stem != "__main__"
    ]
    args = {
        "site": str(site),
        "modules": modules,
        "top": f"shardkit.{pkg.name}",
        "dist": pkg.dist_name,
        "version": version,
        "allowed": allowed,
        "forbidden": sorted(set(packages) - set(allowed) - {pkg.name}),
    }
    t = time.perf_counter()
    proc = _run([str(python), "-I", "-c", _IMPORT_SCRIPT, json.dumps(args)], cwd=base)
    phases["import"] = time.perf_counter() - t
    try:
        errors = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return ["the import check crashed:\n" + _tail(proc.stderr or proc.stdout)]
    return [str(e) for e in errors]


# --------------------------------------------------------------------------------------------
# Command line


def _print_table(results: Sequence[Result], dynamic: bool) -> None:
    header = ["package", "version", "deps", "static", "install+import", "seconds"]
    rows = []
    for r in results:
        dyn = "skipped" if r.dynamic is None else ("ok" if not r.dynamic else "FAIL")
        rows.append(
            [
                DIST_PREFIX + r.name,
                r.version,
                ",".join(r.deps) or "-",
                "ok" if not r.static else "FAIL",
                dyn if dynamic else "-",
                f"{r.seconds:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="check_packages.py",
        description="Static import/layout checks and install-alone checks for every package.",
    )
    parser.add_argument("--static-only", action="store_true", help="skip wheel builds and venvs")
    parser.add_argument(
        "--package", action="append", metavar="NAME", help="check only NAME (repeatable)"
    )
    parser.add_argument(
        "--jobs", type=int, default=min(4, os.cpu_count() or 1), help="parallel venvs"
    )
    parser.add_argument("--root", type=Path, default=None, help="repository root")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print the time of each dynamic phase"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="keep wheels and venvs here (default: temp)"
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = _parse_args(argv)
    root = (args.root or default_root()).resolve()
    t0 = time.perf_counter()
    try:
        packages = load_packages(root)
        if not packages:
            raise ToolError(f"no packages found under {root / 'packages'}")
        selected = (
            [find_package(packages, n).name for n in args.package]
            if args.package
            else [p.name for p in packages]
        )
    except ToolError as exc:
        print(f"check_packages: error: {exc}", file=sys.stderr)
        return 2
    by_name = {p.name: p for p in packages}
    results = static_check(packages, root, selected)

    if not args.static_only:
        graph = {p.name: p.sibling_names() for p in packages}
        needed = sorted(
            {n for s in selected for n in [s, *dependency_closure(s, graph)] if n in by_name}
        )
        work = args.work_dir.resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="skchk-"))
        try:
            t_build = time.perf_counter()
            wheels = build_wheels([by_name[n] for n in needed], work / "wheels")
            build_s = time.perf_counter() - t_build
            print(
                f"built {sum(isinstance(w, Path) for w in wheels.values())} wheels in {build_s:.1f}s"
            )

            def run_one(name: str) -> tuple[str, list[str], float]:
                start = time.perf_counter()
                res = results[name]
                if res.version == "?":
                    return name, ["skipped: the version is unreadable (see static problems)"], 0.0
                phases: dict[str, float] = {}
                problems = dynamic_check(
                    by_name[name], res.version, wheels, by_name, work / "venvs", phases
                )
                if args.verbose:
                    detail = ", ".join(f"{k} {v:.1f}s" for k, v in phases.items())
                    print(f"{DIST_PREFIX}{name}: {detail}", flush=True)
                return name, problems, time.perf_counter() - start

            with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
                for name, problems, seconds in pool.map(run_one, selected):
                    results[name].dynamic = problems
                    results[name].seconds += seconds
        finally:
            if args.work_dir is None:
                shutil.rmtree(work, ignore_errors=True)

    ordered = [results[n] for n in selected]
    print()
    _print_table(ordered, not args.static_only)
    failed = [r for r in ordered if not r.ok]
    for r in failed:
        print(f"\n{DIST_PREFIX}{r.name}:")
        for p in [*r.static, *(r.dynamic or [])]:
            first, *rest = p.splitlines() or [""]
            print(f"  - {first}")
            for line in rest:
                print(f"    {line}")
    total = time.perf_counter() - t0
    verdict = f"{len(failed)} of {len(ordered)} packages FAILED" if failed else "all packages ok"
    print(f"\n{verdict} ({total:.1f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
