"""Checks of ``torch.save`` blobs before and after ``torch.load`` decodes them.

A stored item is a ``torch.save`` zip: one ``data.pkl`` (the pickle of the object) and one
record per tensor storage. ``torch.load`` allocates what the pickle declares before it reads, and
its weights-only unpickler hashes every dict key it builds, so both are checked here on the
opcodes alone (``pickletools``; nothing is built): see [Note: Safe DCP reading] and [Note:
Bounded work on untrusted input].

- :func:`open_blob`: the zip's records are uncompressed and no larger than the blob; returns the
  pickle and the record sizes.
- :func:`check_tensor_pickle`: the pickle of a tensor item names no integer above the tensor's
  bytes (a storage size, a shape).
- :func:`scan_object_pickle`: the pickle of a non-tensor item is simulated on a stack of
  *costs*: every object costs one plus the costs of what it was built from, a memo reference
  costs what it refers to, so the cost is the size of the object's expansion as a tree (exact
  for tuples and frozensets, which are immutable: the only containers a hash or an equality
  walks). A cost above the budget is refused before ``torch.load`` runs. Every storage the
  pickle names must be a record of the zip with at least that many bytes.
- :func:`measure_object`: the decoded object, walked once per object (a memo by ``id``): its
  expansion as a tree must stay under the budget too (lists and dicts filled after they were
  referenced escape the opcode simulation), and it must hold no cycle.
"""

from __future__ import annotations

import io
import pickletools
import zipfile
from collections import OrderedDict
from typing import IO, Any

import torch
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import UnsafeCheckpointError

__all__ = [
    "check_tensor_pickle",
    "expansion_budget",
    "measure_object",
    "open_blob",
    "scan_object_pickle",
]

_MARK = object()


def expansion_budget(nbytes: int) -> int:
    """The largest expansion a stored object of ``nbytes`` bytes may have: 64 nodes per byte,
    and at least 2**20 (ordinary state, however much it shares, stays far below)."""
    return max(1 << 20, 64 * nbytes)


def _fail(what: str, message: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{what}: {message}; the checkpoint is damaged or crafted")


def open_blob(f: IO[bytes] | io.RawIOBase, length: int, what: str) -> tuple[bytes, dict[str, int]]:
    """The pickle of a ``torch.save`` zip read from ``f`` (``length`` bytes), and the size of
    each of its records by name (``"<archive>/data/0"``).

    Raises:
        UnsafeCheckpointError: not a zip of uncompressed records no larger than ``length`` with
            one ``data.pkl``.
    """
    try:
        with zipfile.ZipFile(f) as z:
            pkl: bytes | None = None
            sizes: dict[str, int] = {}
            for info in z.infolist():
                if info.compress_type != zipfile.ZIP_STORED or info.file_size > length:
                    raise _fail(
                        what, f"its record {describe(info.filename)} is compressed or oversized"
                    )
                sizes[info.filename] = info.file_size
                if info.filename.endswith("/data.pkl"):
                    if pkl is not None:
                        raise _fail(what, "it holds two pickles")
                    pkl = z.read(info)
    except UnsafeCheckpointError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise _fail(what, f"its data is not a torch.save record ({type(e).__name__})") from None
    if pkl is None:
        raise _fail(what, "it holds no pickle (data.pkl)")
    return pkl, sizes


def check_tensor_pickle(pkl: bytes, nbytes: int, what: str) -> None:
    """The pickle of a stored tensor of ``nbytes`` bytes declares nothing larger.

    Raises:
        UnsafeCheckpointError: an integer above ``max(nbytes, 64 KiB)``, or a malformed pickle.
    """
    bound = max(nbytes, 1 << 16)
    try:
        for op, arg, _ in pickletools.genops(pkl):
            if type(arg) is int and abs(arg) > bound:
                raise _fail(
                    what, f"its record declares {describe(arg)} (op {op.name}) for {nbytes} bytes"
                )
    except UnsafeCheckpointError:
        raise
    except (ValueError, EOFError) as e:
        raise _fail(what, f"its pickle is malformed ({type(e).__name__})") from None


class _Node:
    """What the simulation knows of one object: the size of its expansion, and its value when it
    is an atom or a short tuple of atoms (enough to read a persistent id)."""

    __slots__ = ("cost", "value")

    def __init__(self, cost: int, value: Any = None) -> None:
        self.cost = cost
        self.value = value


def _atom_value(arg: Any) -> Any:
    if type(arg) in (int, bool, float) or arg is None:
        return arg
    if type(arg) in (str, bytes) and len(arg) <= 256:
        return arg
    return None


def _int(arg: Any) -> int:
    if type(arg) is not int:
        raise ValueError("a memo opcode without an index")
    return arg


def scan_object_pickle(pkl: bytes, records: dict[str, int], what: str, budget: int) -> None:
    """Simulates the pickle of a stored object on costs (see the module docstring).

    Args:
        pkl: the pickle (``data.pkl``).
        records: the zip's record sizes, from :func:`open_blob`.
        what: names the item in errors.
        budget: the largest expansion allowed (:func:`expansion_budget`).

    Raises:
        UnsafeCheckpointError: an expansion above ``budget``, a storage that is not a record of
            the zip or is shorter than declared, or a malformed pickle.
    """
    stack: list[Any] = []
    memo: dict[int, _Node] = {}
    data_dir = {
        name.rsplit("/data/", 1)[1]: size for name, size in records.items() if "/data/" in name
    }

    def pop() -> Any:
        if not stack:
            raise _fail(what, "its pickle pops an empty stack")
        return stack.pop()

    def pop_node() -> _Node:
        node = pop()
        if node is _MARK:
            raise _fail(what, "its pickle uses a MARK as an object")
        return node  # type: ignore[no-any-return]

    try:
        for op, arg, pos in pickletools.genops(pkl):
            name = op.name
            if name in ("PROTO", "FRAME", "STOP"):
                continue
            if name == "MARK":
                stack.append(_MARK)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                if not stack or stack[-1] is _MARK:
                    raise _fail(what, f"its pickle memoizes nothing at byte {pos}")
                memo[len(memo) if name == "MEMOIZE" else _int(arg)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                node = memo.get(_int(arg))
                if node is None:
                    raise _fail(what, f"its pickle reads an undefined memo entry at byte {pos}")
                stack.append(node)
            elif name == "DUP":
                stack.append(pop_node())
                stack.append(stack[-1])
            elif name == "POP":
                pop()
            elif name == "BINPERSID":
                _check_storage_id(pop_node().value, data_dir, what)
                stack.append(_Node(1))
            elif name == "PERSID":
                raise _fail(
                    what, "its pickle uses a text persistent id, which torch.save never writes"
                )
            else:
                before = [s.name for s in op.stack_before]
                popped: list[_Node] = []
                if "mark" in before:
                    while stack and stack[-1] is not _MARK:
                        popped.append(stack.pop())
                    if not stack:
                        raise _fail(what, f"its pickle has no MARK before byte {pos}")
                    stack.pop()
                    popped.extend(pop_node() for _ in range(before.index("mark")))
                else:
                    popped.extend(pop_node() for _ in range(len(before)))
                cost = 1 + sum(n.cost for n in popped)
                if cost > budget:
                    raise _fail(
                        what,
                        f"it holds a structure whose expansion exceeds {budget} objects (shared "
                        f"references nested like a 'billion laughs')",
                    )
                value = _atom_value(arg)
                if name == "GLOBAL" and type(arg) is str:
                    value = ("global", arg[:256])
                elif name.startswith("TUPLE") and len(popped) <= 8:
                    values = [n.value for n in reversed(popped)]
                    value = tuple(values) if all(v is not None for v in values) else None
                stack.extend(_Node(cost, value) for _ in op.stack_after)
    except UnsafeCheckpointError:
        raise
    except (ValueError, EOFError) as e:
        raise _fail(what, f"its pickle is malformed ({type(e).__name__})") from None


def _check_storage_id(pid: Any, data_dir: dict[str, int], what: str) -> None:
    """``("storage", storage type, key, location, numel)``: torch.save's persistent id."""
    if not (
        type(pid) is tuple
        and len(pid) == 5
        and pid[0] == "storage"
        and type(pid[2]) is str
        and type(pid[4]) is int
    ):
        raise _fail(what, f"its pickle names a storage by {describe(pid)}, not torch.save's id")
    size = data_dir.get(pid[2])
    if size is None or size < pid[4]:
        raise _fail(
            what,
            f"its pickle declares a storage of {describe(pid[4])} elements in record "
            f"{describe(pid[2])}, which {'is absent' if size is None else f'has {size} bytes'}",
        )


_CONTAINERS = (list, tuple, set, frozenset, dict, OrderedDict)


def _pairs(node: Any) -> Any:
    """A container's children, as pairs (a dict's key and value) or 1-tuples."""
    return node.items() if isinstance(node, dict) else ((x,) for x in node)


def measure_object(obj: Any, budget: int, what: str) -> None:
    """Refuses a decoded object whose expansion as a tree exceeds ``budget``, or that holds a
    cycle; each object is visited once (see the module docstring).

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
        active.add(key)
        work.append((node, True))
        for pair in _pairs(node):
            for child in pair:
                if type(child) in _CONTAINERS and id(child) not in sizes:
                    work.append((child, False))


def decode_object(blob: bytes, what: str, *, weights_only: bool = True) -> Any:
    """``torch.load`` of a stored non-tensor item after :func:`scan_object_pickle`, then
    :func:`measure_object`.

    Raises:
        UnsafeCheckpointError: the blob fails a check, or (``weights_only``) holds a pickled
            object outside torch's weights-only allow-list.
    """
    budget = expansion_budget(len(blob))
    pkl, records = open_blob(io.BytesIO(blob), len(blob), what)
    scan_object_pickle(pkl, records, what, budget)
    try:
        obj = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=weights_only)
    except Exception as e:
        # torch's message names the refused global; it quotes no structure of the file
        raise UnsafeCheckpointError(
            f"{what} holds a pickled object outside torch's weights-only allow-list "
            f"({type(e).__name__}: {str(e)[:300]}); it is refused (pass allow_pickle=True only "
            f"for a checkpoint you trust)"
        ) from None
    measure_object(obj, budget, what)
    return obj
