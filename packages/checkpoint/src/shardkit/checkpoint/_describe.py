"""A bounded description of untrusted values, for error messages.

[Note: Bounded work on untrusted input]
Reading a checkpoint's metadata and records costs time and memory linear in their size. A
pickle or JSON document of a few KB can describe a structure whose *expansion* is astronomically
large: a tuple holding the same tuple twice, nested 60 times ("billion laughs"), is 60 objects
in memory but 2**60 leaves to anything that walks it as a tree. ``repr``, ``==``, ``hash`` and
``str.format(..., "{!r}")`` all walk it as a tree (``f"{x!r:.100}"`` renders the whole ``repr``
before cutting it), so shardkit never applies them to untrusted containers:

- error messages describe untrusted values with :func:`describe`: atoms (bounded), containers by
  type and length with a preview of at most ``budget`` nodes, each object visited once (a shared
  reference prints as ``<shared>``);
- the allow-list unpickler accepts only flat dict keys and set items (atoms, validated
  ``torch.Size`` and ``MetadataIndex``), so building a dict never hashes or compares a deep
  structure (see [Note: Allow-list unpickling]);
- stored items are decoded by the same allow-list machine (never by ``torch.load``), whose
  allowed calls are charged the size of their arguments against a budget of 64 units per
  pickle byte, with at most 16 keys of one hash per container (see [Note: Hash flooding]);
  a decoded non-tensor item is then measured object by object (``_scan.py``);
- JSON records are parsed only below a fixed nesting depth, and their ints and lengths are
  bounded before use (``_records.py``).

The fuzz suite's structural bombs (``tests/test_bombs.py``) hold every reader to this, with the
time and memory each may take.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import pathlib

import torch

__all__ = ["describe"]

_ATOM_CHARS = 80
_LONG_INT = 10**30


def describe(value: object, budget: int = 16) -> str:
    """A short description of ``value``, safe on untrusted input.

    Never calls ``repr``, ``str``, ``==`` or ``hash`` on a container or an object of unknown
    type: atoms are shown bounded (strings and bytes cut to 80 characters, huge ints by their
    size in bits), containers by type and length with a preview of their first items, at most
    ``budget`` nodes in all, each object described once (a shared reference reads
    ``<shared>``; see [Note: Bounded work on untrusted input]). The cost is ``O(budget)``
    whatever ``value`` is.

    Args:
        value: anything (typically something read from a checkpoint).
        budget: how many nodes the preview may show.

    Returns:
        e.g. ``"tuple of 2: (tuple of 2: (<shared>, <shared>), <shared>)"``.
    """
    return _Describer(budget).run(value, 0)


class _Describer:
    def __init__(self, budget: int) -> None:
        self.left = max(budget, 1)
        self.seen: set[int] = set()

    def run(self, v: object, depth: int) -> str:
        self.left -= 1
        atom = _atom(v)
        if atom is not None:
            return atom
        if id(v) in self.seen:
            return "<shared>"
        self.seen.add(id(v))
        kind = type(v).__name__
        if isinstance(v, (tuple, list, set, frozenset, dict)):
            n = len(v)
            head = f"{kind} of {n}" if type(v) is not torch.Size else f"torch.Size of {n} dims"
            if n == 0 or self.left <= 0 or depth >= 3:
                return head
            # islice: never more than 8 items taken, whatever the length (a set is iterated,
            # never re-hashed)
            items = list(itertools.islice(v.items() if isinstance(v, dict) else v, 8))
            parts: list[str] = []
            for item in items:
                if self.left <= 0:
                    break
                if isinstance(v, dict):
                    k, x = item
                    parts.append(f"{self.run(k, depth + 1)}: {self.run(x, depth + 1)}")
                else:
                    parts.append(self.run(item, depth + 1))
            more = ", ..." if len(parts) < n else ""
            return f"{head}: ({', '.join(parts)}{more})"
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            state = getattr(v, "__dict__", None)
            if not isinstance(state, dict) or self.left <= 0 or depth >= 3:
                return kind
            fields = [
                f"{k}={self.run(x, depth + 1)}"
                for k, x in itertools.islice(state.items(), 6)
                if type(k) is str
            ]
            return f"{kind}({', '.join(fields)})"
        return f"a {kind}"


def _atom(v: object) -> str | None:
    """Bounded text of a scalar (None when ``v`` is not one)."""
    if v is None or type(v) in (bool, float):
        return repr(v)
    if type(v) is int:
        if -_LONG_INT < v < _LONG_INT:
            return repr(v)
        return f"an int of {v.bit_length()} bits"
    if type(v) in (str, bytes, bytearray):
        n = len(v)  # type: ignore[arg-type]
        text = v[:_ATOM_CHARS]  # type: ignore[index]
        unit = "chars" if type(v) is str else "bytes"
        return f"{text!r}... ({n} {unit})" if n > _ATOM_CHARS else repr(text)
    if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
        return str(v)
    if isinstance(v, enum.Enum) and type(v.value) in (int, str):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, pathlib.PurePath):
        return _atom(v.as_posix())
    return None
