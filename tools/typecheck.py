#!/usr/bin/env python3
"""Run mypy --strict (the root pyproject.toml config) over every package and report per package.

    python tools/typecheck.py [--package NAME ...] [--separate] [--root PATH] [-- MYPY_ARGS...]

By default one mypy process checks the explicit paths `packages/<name>/src/shardkit/<name>` of all
selected packages (one load of torch's stubs, so it is the fast path) and the errors are attributed
to packages by file. `--separate` runs one mypy process per package instead, which also shows that
each package type-checks on its own. `-p shardkit` is never used: with a PEP 420 namespace spread
over several `src/` folders it would silently check only the first one found.
Exit status: 0 clean, 1 type errors, 2 bad usage or mypy crashed / not installed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _monorepo import Package, ToolError, default_root, find_package, load_packages

__all__ = ["PackageReport", "main", "run_mypy"]

_ERROR_RE = re.compile(r"^(?P<path>[^:\n]+?\.pyi?):\d+(?::\d+)?: (?P<kind>error|note): ")


@dataclass
class PackageReport:
    """mypy's verdict for one package.

    Attributes:
        name: Package folder name.
        files: Number of source files checked.
        errors: Error lines (with their notes) attributed to the package.
        seconds: Wall time of the mypy run that checked it (shared in the combined mode).
    """

    name: str
    files: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _target(pkg: Package, root: Path) -> str:
    return pkg.src_dir.relative_to(root).as_posix()


def _owner(path: str, targets: dict[str, str]) -> str | None:
    norm = Path(path).as_posix()
    for target, name in targets.items():
        if norm == target or norm.startswith(target + "/"):
            return name
    return None


def run_mypy(
    root: Path, packages: Sequence[Package], everyone: Sequence[Package], extra: Sequence[str]
) -> tuple[int, dict[str, list[str]], list[str], float]:
    """One mypy run over `packages`: (status, error lines by package, other lines, seconds).

    Errors are attributed by file to any package of `everyone` (mypy also reports errors in the
    sibling modules it follows imports into).
    """
    targets = {_target(p, root): p.name for p in everyone}
    checked = [_target(p, root) for p in packages]
    cmd = [sys.executable, "-m", "mypy"]
    config = root / "pyproject.toml"
    if config.is_file():
        cmd += ["--config-file", str(config)]
    cmd += ["--strict", "--no-color-output", "--no-error-summary", *extra, *checked]
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    env["MYPY_FORCE_COLOR"] = "0"
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=root, env=env, capture_output=True, text=True, check=False, timeout=1800
    )
    seconds = time.perf_counter() - start
    by_pkg: dict[str, list[str]] = {p.name: [] for p in everyone}
    other: list[str] = []
    last: list[str] | None = None
    for line in (proc.stdout + proc.stderr).splitlines():
        m = _ERROR_RE.match(line)
        if m is None:
            if line.strip() and last is not None:
                last.append(line)  # continuation (source snippet, caret)
            elif line.strip():
                other.append(line)
            continue
        name = _owner(m.group("path"), targets)
        last = by_pkg[name] if name is not None else other
        last.append(line)
    return proc.returncode, by_pkg, other, seconds


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(
        prog="typecheck.py", description="mypy --strict over every package, reported per package."
    )
    parser.add_argument("--package", action="append", metavar="NAME", help="only NAME (repeatable)")
    parser.add_argument(
        "--separate", action="store_true", help="one mypy process per package (slower)"
    )
    parser.add_argument("--root", type=Path, default=None, help="repository root")
    return parser.parse_args(argv), extra


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args, extra = _parse_args(argv)
    root = (args.root or default_root()).resolve()
    try:
        import mypy  # noqa: F401
    except ImportError:
        print("typecheck: error: mypy is not installed: pip install mypy", file=sys.stderr)
        return 2
    try:
        packages = load_packages(root)
        if args.package:
            packages = [find_package(packages, n) for n in args.package]
        missing = [p.name for p in packages if not p.src_dir.is_dir()]
        if missing:
            raise ToolError(f"no src/shardkit/<name>/ folder for: {', '.join(missing)}")
        if not packages:
            raise ToolError(f"no packages found under {root / 'packages'}")
    except ToolError as exc:
        print(f"typecheck: error: {exc}", file=sys.stderr)
        return 2

    try:
        everyone = load_packages(root)
    except ToolError:  # pragma: no cover - loaded successfully just above
        everyone = list(packages)
    reports = {
        p.name: PackageReport(p.name, files=sum(1 for _ in p.src_dir.rglob("*.py")))
        for p in packages
    }
    problems: list[str] = []
    total_seconds = 0.0
    runs = [[p] for p in packages] if args.separate else [list(packages)]
    for group in runs:
        status, by_pkg, other, seconds = run_mypy(root, group, everyone, extra)
        total_seconds += seconds
        for name, lines in by_pkg.items():
            if lines and name not in reports:
                reports[name] = PackageReport(name)  # an imported sibling with errors
            if name in reports:
                reports[name].errors = list(dict.fromkeys([*reports[name].errors, *lines]))
        for pkg in group:
            reports[pkg.name].seconds += seconds
        # Exit status 2, or 1 without any error line, is a crash or a configuration error.
        if status not in (0, 1) or (status == 1 and not any(by_pkg.values())):
            problems.append(
                f"mypy exited with status {status} checking {', '.join(p.name for p in group)}:"
            )
            problems.extend(f"  {line}" for line in other)
        elif other:
            problems.extend(other)

    width = max(len(n) for n in reports)
    mode = "one process per package" if args.separate else "one process, explicit per-package paths"
    print(f"mypy --strict ({mode})")
    failed: list[str] = []
    for rep in reports.values():
        n_err = sum(1 for line in rep.errors if _ERROR_RE.match(line) and ": error: " in line)
        if n_err:
            failed.append(rep.name)
        verdict = "ok" if n_err == 0 else f"FAIL ({n_err} errors)"
        print(
            f"  shardkit-{rep.name.ljust(width)}  {rep.files:3d} files  {rep.seconds:6.1f}s  {verdict}"
        )
    for rep in reports.values():
        if rep.errors:
            print(f"\nshardkit-{rep.name}:")
            print("\n".join(f"  {line}" for line in rep.errors))
    if problems:
        print("\n" + "\n".join(problems), file=sys.stderr)
    crashed = any(line.startswith("mypy exited") for line in problems)
    verdict = "FAILED: " + ", ".join(failed) if failed else "all packages clean"
    if crashed:
        verdict = "mypy did not complete"
    print(f"\n{verdict} ({total_seconds:.1f}s)")
    return 2 if crashed else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
