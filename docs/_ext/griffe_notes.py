"""Griffe extension for the docs build: Markdown-friendly docstrings.

Two rewrites, applied to the docstrings griffe loads (the package sources are left as they are):

1. Sphinx roles (``:class:`Partition```, ``:meth:`step```, ...) become inline code, which is
   what they mean to a reader; Markdown would otherwise show the role markup verbatim.
2. ``# [Note: Title]`` blocks become admonitions (below).

CONTRIBUTING.md asks for one ``# [Note: Title]`` comment block per subtle invariant. A few of
them sit inside docstrings, where Markdown would turn every ``# ...`` line into a top-level
heading. This extension rewrites such a block (a ``# [Note: Title]`` line and the ``#`` lines
that follow it) into a Material "note" admonition before mkdocstrings renders the docstring.
Only the rendered site changes; the package sources are left as they are.

Loaded by mkdocstrings-python from ``mkdocs.yml`` (``extensions: [docs/_ext/griffe_notes.py]``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

__all__ = ["NoteBlocks", "rewrite_notes", "rewrite_roles"]

_NOTE = re.compile(r"^(\s*)#\s*\[Note:\s*(?P<title>[^\]]+)\]\s*$")
_ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const):`~?(?P<target>[^`]+)`"
)
_COMMENT = re.compile(r"^(\s*)#(?: (?P<text>.*)|)$")


def rewrite_notes(text: str) -> str:
    """``text`` with every ``# [Note: ...]`` comment block turned into an admonition."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        head = _NOTE.match(lines[i])
        if head is None:
            out.append(lines[i])
            i += 1
            continue
        indent = head.group(1)
        title = head.group("title").strip().replace('"', "'")
        body: list[str] = []
        i += 1
        while i < len(lines):
            line = _COMMENT.match(lines[i])
            if line is None or line.group(1) != indent:
                break
            body.append(line.group("text") or "")
            i += 1
        if out and out[-1].strip():
            out.append("")
        out.append(f'{indent}!!! note "Note: {title}"')
        out.extend(f"{indent}    {b}".rstrip() for b in body)
        out.append("")
    return "\n".join(out)


def rewrite_roles(text: str) -> str:
    """``text`` with Sphinx cross-reference roles turned into inline code."""
    return _ROLE.sub(lambda m: f"`{m.group('target')}`", text)


class NoteBlocks(griffe.Extension):
    """Rewrites Sphinx roles and ``# [Note: ...]`` blocks in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        text = rewrite_roles(obj.docstring.value)
        if "[Note:" in text:
            text = rewrite_notes(text)
        obj.docstring.value = text
