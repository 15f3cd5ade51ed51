"""tools/release.py against a fake monorepo."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import release
from _monorepo import ToolError, read_about_version, tomllib
from release import bump_version, render_changelog, replace_toml_string, widen_specs


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _deps(root: Path, name: str) -> list[str]:
    with (root / "packages" / name / "pyproject.toml").open("rb") as f:
        deps: list[str] = tomllib.load(f)["project"]["dependencies"]
    return deps


@pytest.mark.parametrize(
    ("current", "how", "expected"),
    [
        ("0.1.0", "patch", "0.1.1"),
        ("0.1.3", "minor", "0.2.0"),
        ("0.1.3", "major", "1.0.0"),
        ("1.2", "patch", "1.2.1"),
        ("0.2.0rc1", "patch", "0.2.0"),
        ("0.1.0", "0.3.0", "0.3.0"),
        ("0.1.0", "0.2.0-rc.1", "0.2.0rc1"),
    ],
)
def test_bump_version(current: str, how: str, expected: str) -> None:
    assert bump_version(current, how) == expected


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("0.1.0", "not greater"),
        ("0.0.9", "not greater"),
        ("banana", "not a PEP 440"),
        ("0.2+cpu", "local"),
    ],
)
def test_bump_version_rejects(how: str, match: str) -> None:
    with pytest.raises(ToolError, match=match):
        bump_version("0.1.0", how)


@pytest.mark.parametrize(
    ("specs", "new", "expected"),
    [
        (((">=", "0.1"), ("<", "0.2")), "0.2.0", ((">=", "0.1"), ("<", "0.3"))),
        (((">=", "0.1"), ("<=", "0.1.9")), "0.2.0", ((">=", "0.1"), ("<", "0.3"))),
        ((("~=", "0.1"),), "1.0.0", ((">=", "0.1"), ("<", "2"))),
        ((("==", "0.1.*"),), "0.2.0", ((">=", "0.1"), ("<", "0.3"))),
        (
            ((">=", "0.1"), ("<", "0.2"), ("!=", "0.1.5")),
            "0.2.0",
            ((">=", "0.1"), ("!=", "0.1.5"), ("<", "0.3")),
        ),
        (((">=", "0.1"), ("<", "1")), "0.5.0", ((">=", "0.1"), ("<", "1"))),
    ],
)
def test_widen_specs(
    specs: tuple[tuple[str, str], ...], new: str, expected: tuple[tuple[str, str], ...]
) -> None:
    assert widen_specs(specs, new) == expected


def test_widen_specs_refuses_pins_and_high_lower_bounds() -> None:
    with pytest.raises(ToolError, match="exact pin"):
        widen_specs((("==", "0.1.0"),), "0.2.0")
    with pytest.raises(ToolError, match="lower bound"):
        widen_specs(((">=", "0.3"),), "0.2.0")


def test_replace_toml_string_keeps_layout_and_comments() -> None:
    text = (
        '[project]\n# keep "a>=1" here\ndependencies = [\n  "a>=1",  # trailing\n  \'b\',\n]\n'
        '[tool.x]\nother = """a>=1"""\n'
    )
    out, n = replace_toml_string(text, "a>=1", "a>=1,<3")
    assert n == 2
    expected = text.replace('  "a>=1",', '  "a>=1,<3",').replace('"""a>=1"""', '"a>=1,<3"')
    assert out == expected
    out, n = replace_toml_string(text, "a>=1", 'a>=1; python_version >= "3.10"')
    assert tomllib.loads(out)["project"]["dependencies"][0] == 'a>=1; python_version >= "3.10"'


_KEEP = (
    "# Changelog\n\nIntro.\n\n## [Unreleased]\n\n"
    "## [0.1.0] - 2024-01-01\n\n### Added\n\n- First release.\n"
)


def test_render_changelog_adds_a_keep_a_changelog_section() -> None:
    out = render_changelog(
        _KEEP, "shardkit-x", "0.2.0", "2024-05-01", ["Faster.\nMuch faster.", "- Fix"]
    )
    assert out == (
        "# Changelog\n\nIntro.\n\n## [Unreleased]\n\n## [0.2.0] - 2024-05-01\n\n### Changed\n\n"
        "- Faster.\n  Much faster.\n- Fix\n\n## [0.1.0] - 2024-01-01\n\n### Added\n\n"
        "- First release.\n"
    )
    fixed = render_changelog(_KEEP, "shardkit-x", "0.1.1", "2024-05-01", ["Bug"], "fixed")
    assert "## [0.1.1] - 2024-05-01\n\n### Fixed\n\n- Bug\n\n## [0.1.0]" in fixed
    with pytest.raises(ToolError, match=r"already has an entry for 0\.1\.0"):
        render_changelog(_KEEP, "shardkit-x", "0.1.0", "2024-05-01", ["again"])
    with pytest.raises(ToolError, match="empty release message"):
        render_changelog(_KEEP, "shardkit-x", "0.2.0", "2024-05-01", ["  "])
    with pytest.raises(ToolError, match="unknown changelog section 'improved'"):
        render_changelog(_KEEP, "shardkit-x", "0.2.0", "2024-05-01", ["m"], "improved")


def test_render_changelog_moves_unreleased_entries_into_the_release() -> None:
    text = _KEEP.replace(
        "## [Unreleased]\n\n",
        "## [Unreleased]\n\n### Fixed\n\n- A fix.\n\n### Added\n\n- A feature.\n  More.\n\n",
    )
    out = render_changelog(text, "shardkit-x", "0.2.0", "2024-05-01", ["Another fix"], "Fixed")
    assert out == (
        "# Changelog\n\nIntro.\n\n## [Unreleased]\n\n## [0.2.0] - 2024-05-01\n\n"
        "### Added\n\n- A feature.\n  More.\n\n### Fixed\n\n- A fix.\n- Another fix\n\n"
        "## [0.1.0] - 2024-01-01\n\n### Added\n\n- First release.\n"
    )
    # No message needed when Unreleased lists the changes; nothing at all is refused.
    assert "### Fixed\n\n- A fix.\n" in render_changelog(text, "shardkit-x", "0.2.0", "d", [])
    with pytest.raises(ToolError, match=r"nothing to record.*-m/--message.*\[Unreleased\]"):
        render_changelog(_KEEP, "shardkit-x", "0.2.0", "2024-05-01", [])


def test_render_changelog_starts_or_converts_a_changelog() -> None:
    new = render_changelog(None, "shardkit-x", "0.2.0", "2024-05-01", ["m"])
    assert new.startswith("# Changelog\n\nAll notable changes to shardkit-x")
    assert "[Keep a Changelog](https://keepachangelog.com/en/1.1.0/)" in new
    assert new.endswith("## [Unreleased]\n\n## [0.2.0] - 2024-05-01\n\n### Changed\n\n- m\n")
    old_style = "# Changelog: shardkit-x\n\n## 0.1.0\n\n- First release.\n"
    out = render_changelog(old_style, "shardkit-x", "0.2.0", "2024-05-01", ["m"])
    assert out == (
        "# Changelog: shardkit-x\n\n## [Unreleased]\n\n## [0.2.0] - 2024-05-01\n\n"
        "### Changed\n\n- m\n\n## 0.1.0\n\n- First release.\n"
    )


def test_patch_release_writes_version_and_changelog(three_packages: Path) -> None:
    root = three_packages
    rc = release.main(
        ["core", "patch", "-m", "Fix a bug", "--date", "2024-05-01", "--root", str(root)]
    )
    assert rc == 0
    assert read_about_version(root / "packages/core/src/shardkit/core/__about__.py") == "0.1.1"
    changelog = (root / "packages/core/CHANGELOG.md").read_text()
    assert changelog.index(
        "## [Unreleased]\n\n## [0.1.1] - 2024-05-01\n\n### Changed\n\n- Fix a bug\n"
    ) < (changelog.index("## [0.1.0]"))
    assert _deps(root, "mid") == ["torch>=2.4", "shardkit-core>=0.1,<0.2"]


def test_section_flag_and_unreleased_entries_on_the_command_line(three_packages: Path) -> None:
    changelog = three_packages / "packages/core/CHANGELOG.md"
    changelog.write_text(
        changelog.read_text().replace(
            "## [Unreleased]\n", "## [Unreleased]\n\n### Added\n\n- New\n"
        )
    )
    argv = ["core", "patch", "--section", "fixed", "-m", "Bug", "--date", "2024-05-01"]
    assert release.main([*argv, "--root", str(three_packages)]) == 0
    text = changelog.read_text()
    assert (
        "## [Unreleased]\n\n## [0.1.1] - 2024-05-01\n\n### Added\n\n- New\n\n### Fixed\n\n- Bug\n"
        in text
    )
    assert text.count("- New") == 1


def test_conflicting_release_fails_and_writes_nothing(
    three_packages: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = three_packages
    before = _snapshot(root)
    rc = release.main(["shardkit-core", "minor", "-m", "API change", "--root", str(root)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "shardkit-mid requires shardkit-core>=0.1,<0.2, which does not admit 0.2.0" in err
    assert "shardkit-top requires shardkit-core>=0.1,<0.2, which does not admit 0.2.0" in err
    assert "--update-dependents" in err
    assert _snapshot(root) == before


def test_update_dependents_widens_ranges(
    three_packages: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = three_packages
    mid_before = (root / "packages/mid/pyproject.toml").read_text()
    rc = release.main(
        ["core", "minor", "-m", "API change", "--update-dependents", "--root", str(root)]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert (
        "widened shardkit-mid's range 'shardkit-core>=0.1,<0.2' -> 'shardkit-core>=0.1,<0.3'" in out
    )
    assert "still excludes the new version" in out
    assert _deps(root, "mid") == ["torch>=2.4", "shardkit-core>=0.1,<0.3"]
    assert _deps(root, "top") == ["torch>=2.4", "shardkit-core>=0.1,<0.3", "shardkit-mid>=0.1,<0.2"]
    mid_after = (root / "packages/mid/pyproject.toml").read_text()
    assert mid_after == mid_before.replace("shardkit-core>=0.1,<0.2", "shardkit-core>=0.1,<0.3")
    assert read_about_version(root / "packages/core/src/shardkit/core/__about__.py") == "0.2.0"


def test_dry_run_writes_nothing(three_packages: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = three_packages
    before = _snapshot(root)
    rc = release.main(
        ["core", "1.0.0", "-m", "Stable", "--update-dependents", "--dry-run", "--root", str(root)]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "shardkit-core: 0.1.0 -> 1.0.0" in out
    assert "would write packages/core/CHANGELOG.md" in out
    assert "shardkit-core>=0.1,<2" in out
    assert _snapshot(root) == before


def test_exact_pin_is_refused_even_with_update(
    repo: Path, make_package: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    make_package("core")
    make_package("user", deps=["torch>=2.4", "shardkit-core==0.1.0"])
    before = _snapshot(repo)
    rc = release.main(["core", "patch", "-m", "x", "--update-dependents", "--root", str(repo)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "shardkit-user pins 'shardkit-core==0.1.0'" in err
    assert "shardkit-core>=0.1,<0.2" in err
    assert _snapshot(repo) == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nope", "patch", "-m", "x"], "unknown package 'nope'; the packages are: core, mid, top"),
        (["core", "0.0.1", "-m", "x"], "not greater than the current version 0.1.0"),
        (["core", "patch", "-m", ""], "empty release message"),
    ],
)
def test_bad_input_is_reported(
    three_packages: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(three_packages)
    assert release.main([*argv, "--root", str(three_packages)]) == 2
    assert message in capsys.readouterr().err
    assert _snapshot(three_packages) == before


def test_existing_changelog_entry_is_refused(
    three_packages: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    changelog = three_packages / "packages/core/CHANGELOG.md"
    changelog.write_text(
        changelog.read_text().replace(
            "## [0.1.0]", "## [0.1.1] - 2024-02-01\n\n### Fixed\n\n- early\n\n## [0.1.0]"
        )
    )
    assert release.main(["core", "patch", "-m", "x", "--root", str(three_packages)]) == 2
    assert "already has an entry for 0.1.1" in capsys.readouterr().err


def test_command_line(three_packages: Path) -> None:
    script = Path(release.__file__)
    proc = subprocess.run(
        [sys.executable, str(script), "mid", "patch", "-m", "cli", "--root", str(three_packages)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "shardkit-mid: 0.1.0 -> 0.1.1" in proc.stdout
    proc = subprocess.run(
        [sys.executable, str(script), "mid", "patch", "--root", str(three_packages)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "-m/--message" in proc.stderr


def test_first_release_of_a_new_package(three_packages: Path) -> None:
    """A package never released (no version heading, entries under Unreleased) is released at
    the version it already declares; once released, that version is taken."""
    changelog = three_packages / "packages/core/CHANGELOG.md"
    changelog.write_text("# Changelog\n\n## [Unreleased]\n\n### Added\n\n- Everything.\n")
    assert bump_version("0.1.0", "0.1.0", first_release=True) == "0.1.0"
    assert bump_version("0.1.0", "patch", first_release=True) == "0.1.1"
    args = ["core", "0.1.0", "--date", "2024-05-01", "--root", str(three_packages)]
    assert release.main(args) == 0
    assert "## [0.1.0] - 2024-05-01\n\n### Added\n\n- Everything.\n" in changelog.read_text()
    assert release.main(args) == 2  # released now: 0.1.0 is not greater than 0.1.0
