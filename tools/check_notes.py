#!/usr/bin/env python3
"""Every ``[Note: Title]`` is defined once, and every reference to one resolves.

CONTRIBUTING.md asks for one ``[Note: Title]`` block per subtle invariant, where it is
established, referenced elsewhere as ``See [Note: Title]``. A *definition* is, in a Python
source, a comment that starts with the title (``# [Note: Title]``, its text on the following
lines or, as a new sentence, on the same one) or a docstring line that holds nothing but the title; every other occurrence,
in Python sources and in Markdown, is a *reference*. The check fails when a title is defined more than once (which
definition does a reference mean?) or referenced without a definition (a note that was
renamed or removed).

Usage:
    python tools/check_notes.py [ROOT]     # default: the repository root; exit 1 on a failure
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

__all__ = ["check", "main", "scan"]

ROOT = Path(__file__).resolve().parent.parent
_DEFINITION = re.compile(
    r"^\s*(?:#\s*\[Note:\s*(?P<comment>[^\]]+?)\s*\](?=\s*$|\s+[A-Z])"
    r"|\[Note:\s*(?P<doc>[^\]]+?)\s*\]\s*$)"
)
_ANY = re.compile(r"\[Note:\s*(?P<title>[^\]]+?)\s*\]")
_SKIP = frozenset({"tools/tests/test_check_notes.py"})
"""This tool's own tests, whose fixtures are notes on purpose."""
_PLACEHOLDER = re.compile(r"^(Title|\.\.\.)$|[{}\\?]")
"""Titles that stand for "some title" (in the docs of this convention and of this tool)."""


def _files(root: Path) -> list[Path]:
    """The tracked (or, outside git, all) ``.py`` and ``.md`` files under ``root``."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.md"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        return sorted(root / p for p in out if (root / p).is_file())
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for ext in ("*.py", "*.md") for p in root.rglob(ext) if ".git" not in p.parts)


def scan(root: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``(definitions, references)``: title -> the ``path:line`` places it occurs."""
    defs: dict[str, list[str]] = defaultdict(list)
    refs: dict[str, list[str]] = defaultdict(list)
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        if rel in _SKIP:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            head = _DEFINITION.match(line) if path.suffix == ".py" else None
            if head is not None:
                defs[head["comment"] or head["doc"]].append(f"{rel}:{n}")
                line = line[head.end() :]
            for m in _ANY.finditer(line):
                if not _PLACEHOLDER.search(m["title"]):
                    refs[m["title"]].append(f"{rel}:{n}")
    return dict(defs), dict(refs)


def check(root: Path) -> list[str]:
    """The problems found under ``root``, one line each (empty: all notes resolve)."""
    defs, refs = scan(root)
    problems = [
        f"[Note: {title}] is defined {len(where)} times: {', '.join(where)}"
        for title, where in sorted(defs.items())
        if len(where) > 1
    ]
    problems += [
        f"[Note: {title}] is referenced but defined nowhere: {', '.join(where[:5])}"
        for title, where in sorted(refs.items())
        if title not in defs
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]).resolve() if args else ROOT
    problems = check(root)
    for line in problems:
        print(line)
    defs, _ = scan(root)
    print(f"{len(defs)} notes, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
