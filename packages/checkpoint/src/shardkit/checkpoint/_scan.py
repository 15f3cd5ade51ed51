"""Bounds on what a stored non-tensor item decodes to.

A stored item is a ``torch.save`` zip, decoded by ``_payload.py`` (see [Note: One decoder for
stored items]): its pickle runs on the allow-list machine, whose work is linear in the pickle.
What it builds may still share references ("billion laughs": a list holding the same list twice,
nested 60 deep, is 60 objects but 2**60 leaves to whatever walks it as a tree later, such as
``copy.deepcopy`` or an equality), so :func:`measure_object` walks the decoded object once per
object (a memo by ``id``): its expansion as a tree must stay under :func:`expansion_budget`,
it must hold no cycle, and its containers may nest at most :data:`MAX_DEPTH` deep (the value is
pickled again for DCP's planner, which recurses per level). :func:`decode_object` does both. See [Note: Bounded work on
untrusted input].
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from shardkit.checkpoint._errors import UnsafeCheckpointError
from shardkit.checkpoint._payload import decode_blob

__all__ = ["MAX_DEPTH", "decode_object", "expansion_budget", "measure_object"]


def expansion_budget(nbytes: int) -> int:
    """The largest expansion a stored object of ``nbytes`` bytes may have: 64 nodes per byte,
    and at least 2**20 (ordinary state, however much it shares, stays far below)."""
    return max(1 << 20, 64 * nbytes)


def _fail(what: str, message: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{what}: {message}; the checkpoint is damaged or crafted")


_CONTAINERS = (list, tuple, set, frozenset, dict, OrderedDict)
MAX_DEPTH = 256
"""The deepest nesting of containers a stored non-tensor item may decode to: its value is
pickled again for DCP's planner (and copied by ``set_state_dict``), which recurse per level."""


def _pairs(node: Any) -> Any:
    """A container's children, as pairs (a dict's key and value) or 1-tuples."""
    return node.items() if isinstance(node, dict) else ((x,) for x in node)


def measure_object(obj: Any, budget: int, what: str) -> None:
    """Refuses a decoded object whose expansion as a tree exceeds ``budget``, that holds a
    cycle, or that nests containers more than :data:`MAX_DEPTH` deep; each object is visited
    once (see the module docstring).

    Raises:
        UnsafeCheckpointError: naming the bound.
    """
    sizes: dict[int, int] = {}  # by id: every object stays alive inside ``obj`` meanwhile
    active: set[int] = set()
    work: list[tuple[Any, bool]] = [(obj, False)]
    while work:
        node, done = work.pop()
        if type(node) not in _CONTAINERS:  # atoms, tensors: one node
            continue
        key = id(node)
        if done:
            total = 1
            for pair in _pairs(node):
                for child in pair:
                    total += sizes.get(id(child), 1)
                    if total > budget:
                        raise _fail(
                            what,
                            f"it decodes to a structure whose expansion exceeds {budget} "
                            f"objects (shared references nested like a 'billion laughs')",
                        )
            sizes[key] = total
            active.discard(key)
            continue
        if key in sizes:
            continue
        if key in active:
            raise _fail(what, f"it decodes to a cyclic {type(node).__name__}")
        active.add(key)  # the containers from obj down to node: the path being walked
        if len(active) > MAX_DEPTH:
            raise _fail(
                what,
                f"it decodes to containers nested more than {MAX_DEPTH} deep (pickling or "
                f"copying it again would exhaust the interpreter's recursion limit)",
            )
        work.append((node, True))
        for pair in _pairs(node):
            for child in pair:
                if type(child) in _CONTAINERS and id(child) not in sizes:
                    work.append((child, False))


def decode_object(blob: bytes | bytearray, what: str) -> Any:
    """A stored non-tensor item, decoded by the allow-list (``_payload.decode_blob``) and
    measured (:func:`measure_object`).

    Raises:
        UnsafeCheckpointError: the blob fails a check.
    """
    value = decode_blob(blob, len(blob), what, tensor=False)
    measure_object(value, expansion_budget(len(blob)), what)
    return value
