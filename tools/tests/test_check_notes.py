"""tools/check_notes.py: every ``[Note: Title]`` defined once, every reference resolves."""

from __future__ import annotations

from pathlib import Path

import check_notes


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_definitions_and_references_resolve(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "a.py": '"""Doc.\n\n[Note: In a docstring]\nText.\n"""\n# [Note: A comment]\n# text\n',
            "b.py": "# [Note: Inline] The rule, as a sentence on the same line.\n"
            "x = 1  # See [Note: A comment]\n"
            "# wrapped: see\n# [Note: In a docstring], which says so.\n",
            "c.md": "See [Note: Inline] and [Note: Title] (a placeholder).\n",
        },
    )
    defs, refs = check_notes.scan(root)
    assert sorted(defs) == ["A comment", "In a docstring", "Inline"]
    assert sorted(refs) == ["A comment", "In a docstring", "Inline"]
    assert check_notes.check(root) == []
    assert check_notes.main([str(root)]) == 0


def test_a_second_definition_and_a_dangling_reference_fail(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "a.py": "# [Note: Twice]\n# text\n",
            "b.py": "# [Note: Twice]\n# other text\n# See [Note: Gone]\n",
        },
    )
    problems = check_notes.check(root)
    assert len(problems) == 2
    assert problems[0].startswith("[Note: Twice] is defined 2 times: a.py:1, b.py:1")
    assert problems[1] == "[Note: Gone] is referenced but defined nowhere: b.py:3"
    assert check_notes.main([str(root)]) == 1
