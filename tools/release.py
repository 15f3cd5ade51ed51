#!/usr/bin/env python3
"""Release one shardkit package: bump its version and add a CHANGELOG entry.

    python tools/release.py <package> {major|minor|patch|X.Y.Z} [-m "what changed" ...]
        [--section {added,changed,deprecated,removed,fixed,security}]
        [--update-dependents] [--dry-run] [--date YYYY-MM-DD] [--root PATH]

Writes `packages/<package>/src/shardkit/<package>/__about__.py` and the top of
`packages/<package>/CHANGELOG.md`, which follows Keep a Changelog
(https://keepachangelog.com/en/1.1.0/): a `## [Unreleased]` section, then one
`## [X.Y.Z] - YYYY-MM-DD` section per release with `### Added` / `### Changed` / `### Fixed` / ...
subsections. The entries already listed under `## [Unreleased]` move into the new version's
section, and each `-m` message becomes one more bullet under `--section` (default: Changed);
at least one of the two must be non-empty. Before writing anything it checks every sibling that depends on
the package: if a sibling's declared range no longer admits the new version the release fails,
naming each sibling and its range, unless `--update-dependents` is given, in which case those
ranges are widened too (and reported). Exact pins (`==X`) between siblings are always refused.
Exit status: 0 released (or dry run), 1 refused because of dependents, 2 bad input.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _monorepo import (
    Package,
    ToolError,
    atomic_write,
    changelog_has_version,
    default_root,
    find_package,
    first_release_pending,
    load_packages,
    tomllib,
)
from _versions import (
    InvalidRequirement,
    InvalidVersion,
    Requirement,
    Version,
    parse_requirement,
    specs_admit,
)

__all__ = [
    "SECTIONS",
    "Edit",
    "bump_version",
    "main",
    "render_about",
    "render_changelog",
    "replace_toml_string",
    "widen_specs",
]

_BUMPS = ("major", "minor", "patch")

# Keep a Changelog's change types, in the order its sections are written.
SECTIONS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")

_CHANGELOG_INTRO = (
    "All notable changes to {dist} are documented in this file.\n\n"
    "The format is based on [Keep a Changelog](https://keepachangelog.com/en/1.1.0/),\n"
    "and this project adheres to [Semantic Versioning](https://semver.org/spec/v2.0.0.html).\n"
)
_UNRELEASED_RE = re.compile(r"^##\s+\[?Unreleased\]?\s*$", re.IGNORECASE | re.MULTILINE)
_H2_RE = re.compile(r"^##\s", re.MULTILINE)
_H3_RE = re.compile(r"^###\s+(.+?)\s*$")


@dataclass(frozen=True)
class Edit:
    """A file and its full new contents.

    Attributes:
        path: The file to write.
        text: Its new contents.
        summary: One line saying what changes.
    """

    path: Path
    text: str
    summary: str


def bump_version(current: str, how: str, *, first_release: bool = False) -> str:
    """The version after a `major`/`minor`/`patch` bump, or `how` itself if it is a version.

    Bumps keep three release components and drop pre/post/dev/local parts:
    `0.1.3 --patch--> 0.1.4`, `0.1.3 --minor--> 0.2.0`, `0.1.3 --major--> 1.0.0`;
    `patch` on a pre-release finalises it (`0.2.0rc1 --patch--> 0.2.0`).
    An explicit version must be a PEP 440 public version greater than `current`, or equal to it
    for the first release of a package never released (``first_release``: its changelog has no
    version heading yet, see ``first_release_pending``).
    """
    cur = Version.parse(current)
    if how in _BUMPS:
        major, minor, patch = (*cur.release, 0, 0)[:3]
        if how == "major":
            new = f"{major + 1}.0.0"
        elif how == "minor":
            new = f"{major}.{minor + 1}.0"
        elif cur.is_prerelease and len(cur.release) >= 3:
            # 0.2.0rc1 --patch--> 0.2.0: finishing a pre-release is the next patch-level step.
            new = ".".join(str(x) for x in cur.release)
        else:
            new = f"{major}.{minor}.{patch + 1}"
    else:
        try:
            parsed = Version.parse(how)
        except InvalidVersion as exc:
            raise ToolError(
                f"bad version argument: {exc}; or use one of {', '.join(_BUMPS)}"
            ) from None
        if parsed.local is not None:
            raise ToolError(
                f"{how!r} has a local label (+...), which cannot be published to an index; "
                "use a public version such as 1.2.3"
            )
        new = str(parsed)
    if first_release and how not in _BUMPS and Version.parse(new) == cur:
        return new
    if not Version.parse(new) > cur:
        raise ToolError(
            f"the new version {new} is not greater than the current version {current}; "
            "choose a higher version"
        )
    return new


def _upper_bound_for(version: Version) -> str:
    """The next incompatible release line: `<0.(m+1)` below 1.0, `<(M+1)` from 1.0 on."""
    major, minor = (*version.release, 0)[:2]
    return f"0.{minor + 1}" if major == 0 else f"{major + 1}"


def widen_specs(specs: tuple[tuple[str, str], ...], new: str) -> tuple[tuple[str, str], ...]:
    """Specifiers that keep their lower bounds and admit `new` (upper bounds moved as needed).

    Upper bounds that exclude `new` (`<`, `<=`, `!=`, `~=`, `==X.*`) are replaced by
    `<next-line>` (see `_upper_bound_for`); `~=A` and `==A.*` keep their lower half as `>=A`.
    Raises `ToolError` for exact pins and for lower bounds above `new`.
    """
    new_v = Version.parse(new)
    kept: list[tuple[str, str]] = []
    dropped_upper = False
    for op, ver in specs:
        if specs_admit(((op, ver),), new):
            kept.append((op, ver))
            continue
        if op in ("==", "===") and not ver.endswith(".*"):
            raise ToolError(f"'{op}{ver}' is an exact pin; siblings must use ranges")
        if op in (">", ">="):
            raise ToolError(f"the lower bound '{op}{ver}' is above {new}; fix the range by hand")
        if op in ("~=", "==") and not any(o in (">", ">=") for o, _ in specs):
            kept.append((">=", ver[:-2] if ver.endswith(".*") else ver))
        dropped_upper = dropped_upper or op != "!="
    has_upper = any(o in ("<", "<=", "~=") or (o == "==" and v.endswith(".*")) for o, v in kept)
    if dropped_upper and not has_upper:
        kept.append(("<", _upper_bound_for(new_v)))
    result = tuple(kept)
    if not specs_admit(result, new):
        raise ToolError(f"cannot widen '{','.join(o + v for o, v in specs)}' to admit {new}")
    return result


_STRING_RE = re.compile(
    r'"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'|#[^\n]*',
    re.DOTALL,
)


def _toml_quote(value: str) -> str:
    if '"' not in value and "\\" not in value:
        return f'"{value}"'
    if "'" not in value and "\n" not in value:
        return f"'{value}'"
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _substitute(doc: Any, old: str, new: str) -> Any:
    if isinstance(doc, dict):
        return {k: _substitute(v, old, new) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_substitute(v, old, new) for v in doc]
    return new if doc == old else doc


def replace_toml_string(text: str, old: str, new: str) -> tuple[str, int]:
    """Replace every TOML string whose value is `old` by `new`, keeping the rest of the layout.

    Comments are skipped. The result is re-parsed and compared with the
    original document where `old` values became `new`, so nothing else can change.
    """
    out: list[str] = []
    pos = 0
    count = 0
    for m in _STRING_RE.finditer(text):
        token = m.group(0)
        if token.startswith("#"):
            continue
        value = tomllib.loads(f"v = {token}")["v"]
        if value == old:
            out.append(text[pos : m.start()])
            out.append(_toml_quote(new))
            pos = m.end()
            count += 1
    out.append(text[pos:])
    result = "".join(out)
    if tomllib.loads(result) != _substitute(tomllib.loads(text), old, new):
        raise ToolError("internal error: rewriting pyproject.toml would change more than intended")
    return result, count


def render_about(text: str, current: str, new: str, path: Path) -> str:
    """`__about__.py` with `__version__` changed from `current` to `new` (layout kept)."""
    pattern = re.compile(
        r"^(__version__\s*(?::\s*str\s*)?=\s*)([\"'])" + re.escape(current) + r"\2",
        re.MULTILINE,
    )
    result, n = pattern.subn(lambda m: f"{m.group(1)}{m.group(2)}{new}{m.group(2)}", text)
    if n != 1:
        raise ToolError(f'{path}: cannot find a single `__version__ = "{current}"` line to bump')
    return result


def _bullets(messages: Sequence[str]) -> list[str]:
    """Markdown bullet lines for `-m` messages (continuation lines indented under their bullet)."""
    bullets: list[str] = []
    for message in messages:
        lines = [line.rstrip() for line in message.strip().splitlines()]
        if not lines or not lines[0]:
            raise ToolError('empty release message; pass -m "what changed"')
        for i, line in enumerate(lines):
            if i == 0:
                bullets.append(line if line.startswith(("- ", "* ")) else f"- {line}")
            elif line.startswith(("- ", "* ")):
                bullets.append(line)
            else:
                bullets.append(f"  {line}" if line else "")
    return bullets


def _section_name(raw: str) -> str:
    """`raw` as one of `SECTIONS` (case-insensitive), or a `ToolError` naming them."""
    for name in SECTIONS:
        if raw.strip().lower() == name.lower():
            return name
    raise ToolError(
        f"unknown changelog section {raw!r}; use one of {', '.join(s.lower() for s in SECTIONS)}"
    )


def _parse_unreleased(body: str, default: str) -> dict[str, list[str]]:
    """The `### <type>` subsections of the Unreleased section as {type: bullet lines}.

    Lines before the first `###` heading count as entries of `default`.
    """
    sections: dict[str, list[str]] = {}
    current = default
    for line in body.splitlines():
        heading = _H3_RE.match(line)
        if heading:
            current = _section_name(heading.group(1))
            continue
        if line.strip() or sections.get(current):
            sections.setdefault(current, []).append(line.rstrip())
    return {name: _trim(lines) for name, lines in sections.items() if _trim(lines)}


def _trim(lines: list[str]) -> list[str]:
    """`lines` without leading and trailing blank lines."""
    first = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    last = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].strip()), -1)
    return lines[first : last + 1]


def render_changelog(
    text: str | None,
    dist: str,
    version: str,
    date: str,
    messages: Sequence[str],
    section: str = "Changed",
) -> str:
    """The changelog (Keep a Changelog form) with a `## [<version>] - <date>` section added.

    The entries under `## [Unreleased]` move into the new section (Unreleased is left empty) and
    each message of `messages` becomes one bullet under `### <section>`. A changelog without an
    Unreleased heading (or no changelog at all) gets one. Raises `ToolError` when the version is
    already listed, when a message is blank, or when there is nothing to record at all.
    """
    section = _section_name(section)
    bullets = _bullets(messages)
    text = text if text is not None and text.strip() else None
    if text is not None and changelog_has_version(text, version):
        raise ToolError(f"CHANGELOG.md of {dist} already has an entry for {version}")
    head = f"# Changelog\n\n{_CHANGELOG_INTRO.format(dist=dist)}\n"
    rest = ""
    unreleased: dict[str, list[str]] = {}
    if text is not None:
        found = _UNRELEASED_RE.search(text)
        if found is not None:
            nxt = _H2_RE.search(text, found.end())
            stop = nxt.start() if nxt is not None else len(text)
            unreleased = _parse_unreleased(text[found.end() : stop], section)
            head, rest = text[: found.start()], text[stop:]
        else:
            first = _H2_RE.search(text)
            if first is None:
                head, rest = text.rstrip("\n") + "\n\n", ""
            else:
                head, rest = text[: first.start()], text[first.start() :]
    if bullets:
        existing = unreleased.setdefault(section, [])
        unreleased[section] = [*existing, *bullets]
    if not any(unreleased.values()):
        raise ToolError(
            f'nothing to record for {dist} {version}: pass -m/--message "what changed" or list '
            "the changes under '## [Unreleased]' in its CHANGELOG.md"
        )
    parts = [f"## [{version}] - {date}\n"]
    for name in SECTIONS:
        if unreleased.get(name):
            parts.append(f"\n### {name}\n\n" + "\n".join(unreleased[name]) + "\n")
    entry = "".join(parts)
    out = head.rstrip("\n") + "\n\n## [Unreleased]\n\n" + entry
    if rest.strip():
        out += "\n" + rest.lstrip("\n")
    return out


@dataclass(frozen=True)
class _Dependent:
    package: Package
    where: str
    requirement: Requirement


def _dependents(packages: Sequence[Package], target: Package) -> list[_Dependent]:
    out: list[_Dependent] = []
    for pkg in packages:
        if pkg.name == target.name:
            continue
        for where, raw in pkg.requirement_strings():
            try:
                req = parse_requirement(raw)
            except InvalidRequirement as exc:
                raise ToolError(
                    f"{pkg.pyproject_path}: bad requirement in {where}: {exc}"
                ) from None
            if req.key == target.dist_name:
                out.append(_Dependent(pkg, where, req))
    return out


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _plan(args: argparse.Namespace, root: Path) -> tuple[list[Edit], list[str], int]:
    """The edits to make, messages to print, and the exit status (non-zero: write nothing)."""
    packages = load_packages(root)
    target = find_package(packages, args.package)
    current = target.version()
    log = target.changelog_path
    first = log.is_file() and first_release_pending(log.read_text(encoding="utf-8"))
    new = bump_version(current, args.bump, first_release=first)
    notes: list[str] = [f"{target.dist_name}: {current} -> {new}"]

    conflicts: list[str] = []
    pins: list[str] = []
    pyproject_texts: dict[Path, str] = {}
    widened: list[str] = []
    for dep in _dependents(packages, target):
        req = dep.requirement
        where = f"{_rel(dep.package.pyproject_path, root)} [project.{dep.where}]"
        if req.url is not None:
            pins.append(f"{dep.package.dist_name} requires {req.raw!r} by URL ({where})")
            continue
        exact = [
            op + v for op, v in req.specs if op == "===" or (op == "==" and not v.endswith(".*"))
        ]
        if exact:
            pins.append(f"{dep.package.dist_name} pins {req.raw!r} ({where})")
            continue
        if specs_admit(req.specs, new):
            continue
        rng = req.specifier or "(no range)"
        conflicts.append(
            f"{dep.package.dist_name} requires {target.dist_name}{rng}, which does not admit "
            f"{new} ({where})"
        )
        if args.update_dependents:
            new_req = req.with_specs(widen_specs(req.specs, new))
            path = dep.package.pyproject_path
            text = pyproject_texts.get(path)
            if text is None:
                text = path.read_text(encoding="utf-8")
            text, count = replace_toml_string(text, req.raw, new_req.raw)
            if count == 0:
                raise ToolError(f"{path}: cannot find the string {req.raw!r} to rewrite")
            pyproject_texts[path] = text
            widened.append(
                f"widened {dep.package.dist_name}'s range {req.raw!r} -> {new_req.raw!r} ({where})"
            )
    if pins:
        msg = [
            f"refusing to release {target.dist_name} {new}: siblings must depend on it by a range"
        ]
        msg += [f"  {p}" for p in pins]
        cur_v = Version.parse(current)
        lower = ".".join(str(x) for x in (*cur_v.release, 0)[:2])
        msg.append(
            f"  fix: replace it by hand with a range such as "
            f"'{target.dist_name}>={lower},<{_upper_bound_for(cur_v)}' (see CONTRIBUTING.md)"
        )
        return [], msg, 1
    if conflicts and not args.update_dependents:
        msg = [
            f"refusing to release {target.dist_name} {new}: dependents would no longer accept it"
        ]
        msg += [f"  {c}" for c in conflicts]
        msg.append(
            "  fix: pick a version inside those ranges, or re-run with --update-dependents to widen "
            "them (then release those dependents too)"
        )
        return [], msg, 1

    edits: list[Edit] = []
    about_text = target.about_path.read_text(encoding="utf-8")
    edits.append(
        Edit(
            target.about_path,
            render_about(about_text, current, new, target.about_path),
            f"__version__ = {new!r}",
        )
    )
    changelog_text = (
        target.changelog_path.read_text(encoding="utf-8")
        if target.changelog_path.exists()
        else None
    )
    edits.append(
        Edit(
            target.changelog_path,
            render_changelog(
                changelog_text, target.dist_name, new, args.date, args.message, args.section
            ),
            f"new section '## [{new}] - {args.date}'",
        )
    )
    for path, text in pyproject_texts.items():
        edits.append(Edit(path, text, "dependency range widened"))
    notes.extend(widened)
    if widened:
        names = sorted({line.split("'s range")[0].removeprefix("widened ") for line in widened})
        notes.append(
            "note: the published metadata of "
            + ", ".join(names)
            + " still excludes the new version until they are released too "
            "(python tools/release.py <name> patch -m ...)"
        )
    return edits, notes, 0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="release.py",
        description="Bump one package's version, add a CHANGELOG entry, check dependents' ranges.",
    )
    parser.add_argument(
        "package", help="package folder name (optim) or distribution (shardkit-optim)"
    )
    parser.add_argument("bump", help="major, minor, patch, or an explicit version such as 0.3.0")
    parser.add_argument(
        "-m",
        "--message",
        action="append",
        default=[],
        help=(
            "what changed: one CHANGELOG bullet under --section (repeat for more); may be left "
            "out when '## [Unreleased]' already lists the changes"
        ),
    )
    parser.add_argument(
        "-s",
        "--section",
        default="changed",
        type=str.lower,
        choices=[name.lower() for name in SECTIONS],
        help="the Keep a Changelog section the -m bullets go under (default: changed)",
    )
    parser.add_argument(
        "--update-dependents",
        action="store_true",
        help="widen siblings' ranges that would exclude the new version",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would change; write nothing"
    )
    parser.add_argument(
        "--date", default=_dt.date.today().isoformat(), help="entry date (YYYY-MM-DD)"
    )
    parser.add_argument(
        "--root", type=Path, default=None, help="repository root (default: this checkout)"
    )
    args = parser.parse_args(argv)
    try:
        _dt.date.fromisoformat(args.date)
    except ValueError:
        parser.error(f"--date must be YYYY-MM-DD, got {args.date!r}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = _parse_args(argv)
    root = (args.root or default_root()).resolve()
    try:
        edits, notes, status = _plan(args, root)
    except ToolError as exc:
        print(f"release: error: {exc}", file=sys.stderr)
        return 2
    if status != 0:
        print("release: error: " + "\n".join(notes), file=sys.stderr)
        print("release: nothing was written", file=sys.stderr)
        return status
    prefix = "would write" if args.dry_run else "wrote"
    for note in notes:
        print(note)
    for edit in edits:
        if not args.dry_run:
            atomic_write(edit.path, edit.text)
        print(f"{prefix} {_rel(edit.path, root)}: {edit.summary}")
    if args.dry_run:
        print("dry run: nothing was written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
