"""The contract shardkit-optim keeps with the distributions built on it (issue 47).

shardkit-ddp and shardkit-overlap import a fixed set of shardkit-optim's public names (the
engine they drive, the agreement, the layout, the torch internals pinned here). Their version
ranges on shardkit-optim reach to ``<1`` because of one rule, stated in the optim README
("Versions"): **a 0.x minor release of shardkit-optim may add to this contract but never
changes or removes any part of it.** This file enforces the rule:

- every name a sibling imports from ``shardkit.optim`` is part of the pinned contract
  (``contract.json`` beside this file): a new use is added to it on purpose;
- every pinned name keeps its surface: a function's signature, a class's constructor and the
  signatures of the public methods and properties shardkit defines on it, a value's type.
  Adding a member passes; changing or removing one fails, naming it.

A change that must break the contract needs the dependents' ranges narrowed and a release of
each (``tools/release.py ... --update-dependents``). After adding to the contract on purpose,
``python packages/optim/tests/test_contract.py --update`` rewrites ``contract.json``.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import shardkit.optim as optim

CONTRACT = Path(__file__).with_name("contract.json")
PACKAGES = Path(__file__).resolve().parents[2]
DEPENDENTS = ("ddp", "overlap")
"""The distributions that build on shardkit-optim (their ranges: ``>=..., <1``)."""


def imported_names(dist: str) -> set[str]:
    """The names ``shardkit-<dist>``'s sources import from ``shardkit.optim``."""
    names: set[str] = set()
    for path in (PACKAGES / dist / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "shardkit.optim":
                names |= {a.name for a in node.names}
    return names


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):  # a builtin without a text signature
        return f"<{type(obj).__name__}>"


def surface(obj: Any) -> dict[str, str] | str:
    """What a dependent relies on of ``obj``: see the module docstring."""
    if inspect.isclass(obj):
        members = {"(constructor)": _signature(obj)}
        for cls in reversed(obj.__mro__):
            if not cls.__module__.startswith("shardkit."):
                continue
            for name, member in vars(cls).items():
                if name.startswith("_"):
                    continue
                if isinstance(member, property):
                    members[name] = "property"
                elif isinstance(member, (staticmethod, classmethod)):
                    members[name] = _signature(member.__func__)
                elif callable(member):
                    members[name] = _signature(member)
        return members
    if callable(obj):
        return _signature(obj)
    return f"value: {type(obj).__name__}"


def current(names: set[str]) -> dict[str, dict[str, str] | str]:
    return {name: surface(getattr(optim, name)) for name in sorted(names)}


def _pinned() -> dict[str, dict[str, str] | str]:
    data: dict[str, dict[str, str] | str] = json.loads(CONTRACT.read_text())
    return data


def _used() -> set[str]:
    return {n for d in DEPENDENTS if (PACKAGES / d / "src").is_dir() for n in imported_names(d)}


def test_every_name_a_dependent_imports_is_in_the_contract() -> None:
    if not all((PACKAGES / d / "src").is_dir() for d in DEPENDENTS):
        pytest.skip("the dependents' sources are not beside this package (not the monorepo)")
    missing = sorted(_used() - set(_pinned()))
    assert not missing, (
        f"shardkit-ddp / shardkit-overlap import {missing} from shardkit.optim, which the pinned "
        f"contract does not hold: add them on purpose (python {__file__} --update)"
    )
    assert all(name in optim.__all__ for name in _pinned()), "the contract names public API only"


def test_the_contract_keeps_every_pinned_surface() -> None:
    pinned = _pinned()
    now = current(set(pinned))
    broken = []
    for name, was in pinned.items():
        is_ = now[name]
        if isinstance(was, dict) and isinstance(is_, dict):
            broken += [
                f"{name}.{member}: {sig} -> {is_.get(member, 'removed')}"
                for member, sig in was.items()
                if is_.get(member) != sig
            ]
        elif was != is_:
            broken.append(f"{name}: {was} -> {is_}")
    assert not broken, (
        "a 0.x minor of shardkit-optim may add to the contract its dependents' ranges (<1) rely "
        "on, never change it (the optim README's Versions): " + "; ".join(broken)
    )


def test_the_dependents_ranges_rest_on_the_contract() -> None:
    """shardkit-ddp and shardkit-overlap declare ``shardkit-optim>=...,<1``."""
    for dist in DEPENDENTS:
        pyproject = PACKAGES / dist / "pyproject.toml"
        if not pyproject.is_file():
            pytest.skip("the dependents are not beside this package (not the monorepo)")
        lines = [ln for ln in pyproject.read_text().splitlines() if '"shardkit-optim' in ln]
        assert len(lines) == 1 and ",<1\"" in lines[0].replace(" ", ""), (dist, lines)


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    names = set(_pinned()) | _used() if CONTRACT.exists() else _used()
    CONTRACT.write_text(json.dumps(current(names), indent=1, sort_keys=True) + "\n")
    print(f"wrote {CONTRACT} ({len(names)} names)")
