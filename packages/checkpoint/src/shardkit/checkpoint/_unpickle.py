"""An allow-list unpickler for the metadata of torch.distributed.checkpoint (DCP).

[Note: Allow-list unpickling]
DCP writes its ``.metadata`` with ``pickle.dump`` and reads it with ``pickle.load``, so a
crafted file runs code on load. ``restricted_loads`` reads it the way torch's weights-only
loader (``torch/_weights_only_unpickler.py``) reads ``torch.load`` files: a small interpreter
of pickle's opcodes written here, in Python, that

- knows only the data opcodes (constants, lists, tuples, dicts, sets, the memo, frames) and
  ``GLOBAL`` / ``STACK_GLOBAL`` / ``REDUCE`` / ``NEWOBJ`` / ``BUILD``; anything else (``INST``,
  ``OBJ``, extensions, out-of-band buffers, and persistent ids unless the caller resolves them:
  the storages of a stored item, see ``_payload.py``) raises at its byte offset;
- resolves a global only from a table (here DCP's metadata classes, torch dtypes,
  layouts, ``torch.Size``, pure paths), *before* importing or building anything: a global
  outside it raises naming it, so no object of an unknown class is ever created;
- never calls the resolved globals directly: each entry of the table is a constructor written
  here that checks its arguments (``torch.Size`` of non-negative ints, a memory-format enum of
  a known value, ...), and ``BUILD`` of a metadata dataclass only sets its declared fields;
- keeps the memo in a dict and reads from a bytes buffer, so a crafted length or memo index
  cannot make it allocate more than the size of the file;
- does work linear in the file (see [Note: Bounded work on untrusted input]): every opcode
  builds at most one object, dict keys and set items must be flat (str, bytes, numbers, None,
  dtypes, layouts, a checked ``torch.Size`` or ``MetadataIndex``, flat tuples of those:
  nothing whose hash or equality walks a nested structure; at most ``MAX_SHARED_HASH`` of one
  hash per container, see [Note: Hash flooding]), allowed calls are charged the size of their
  arguments against :func:`work_budget`, ``BUILD`` runs once per object, and error messages
  describe what they quote with :func:`describe`, never with ``repr``.

The result is then checked field by field (``_metadata.validate_metadata``). The table names
one private torch class, ``torch.distributed.checkpoint.filesystem._StorageInfo`` (what DCP's
file system storage writes per item; see ``_torch_compat.py``) and the pickled name of
``torch.serialization._get_layout`` (never called); ``tests/test_safe_reader.py::
test_metadata_pin`` pins that real DCP metadata reads back equal through this path.
"""

from __future__ import annotations

import codecs
import dataclasses
import enum
import gc
import pathlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as _dcp_fs
import torch.distributed.checkpoint.metadata as _dcp_md
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import UnsafeCheckpointError
from shardkit.checkpoint._torch_compat import MEM_FORMAT, STORAGE_INFO
from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = [
    "DATACLASSES",
    "MAX_SHARED_HASH",
    "Global",
    "UnsafePickleError",
    "flat_set",
    "layout_of",
    "restricted_loads",
    "size_of",
    "work_budget",
]


class UnsafePickleError(UnsafeCheckpointError):
    """A pickle holds something outside the allow-list, is malformed, or exceeds the bounds."""


def _dataclasses() -> dict[tuple[str, str], type]:
    out: dict[tuple[str, str], type] = {}
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
    ):
        cls = getattr(_dcp_md, name, None)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            out[(_dcp_md.__name__, name)] = cls
    if STORAGE_INFO is not None:
        out[(_dcp_fs.__name__, "_StorageInfo")] = STORAGE_INFO
    return out


DATACLASSES = _dataclasses()
"""``(module, name) -> class`` of every DCP metadata dataclass the unpickler may build."""
_MEM_FORMAT: type[enum.Enum] | None = MEM_FORMAT
_FLAT_KEYS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.layout)


def _is_index(v: object) -> bool:
    return type(v) is int and v >= 0


def size_of(*args: Any) -> torch.Size:
    """``torch.Size`` of one tuple of non-negative ints (the allowed ``torch.Size`` global)."""
    if len(args) > 1 or (args and type(args[0]) not in (tuple, list)):
        raise UnsafePickleError(f"torch.Size expects one tuple of ints, got {describe(args)}")
    dims = tuple(args[0]) if args else ()
    if not all(_is_index(d) for d in dims):
        raise UnsafePickleError(f"torch.Size dims must be non-negative ints, got {describe(dims)}")
    return torch.Size(dims)


def layout_of(*args: Any) -> torch.layout:
    """The layout ``torch.serialization._get_layout`` names (never called)."""
    name = args[0] if len(args) == 1 else None
    value = vars(torch).get(name[6:]) if type(name) is str and name[:6] == "torch." else None
    if not isinstance(value, torch.layout):
        raise UnsafePickleError(f"unknown torch layout {describe(args)}")
    return value


def _mem_format(*args: Any) -> enum.Enum:
    if _MEM_FORMAT is None or len(args) != 1 or type(args[0]) is not int:
        raise UnsafePickleError(f"bad memory format encoding {describe(args)}")
    try:
        return _MEM_FORMAT(args[0])
    except ValueError:
        raise UnsafePickleError(f"unknown memory format encoding {describe(args[0])}") from None


def _path(kind: type[pathlib.PurePath]) -> Callable[..., pathlib.PurePath]:
    def make(*args: Any) -> pathlib.PurePath:
        if not all(type(a) is str for a in args):
            raise UnsafePickleError(f"a path's parts must be strs, got {describe(args)}")
        return kind(*args)

    return make


class Global:
    """A resolved allowed global: a safe constructor (REDUCE), a class (NEWOBJ) or a value.

    Args:
        name: ``module.name`` as the pickle wrote it.
        call: the constructor REDUCE runs instead of the global: it checks its arguments before
            it builds anything.
        cls: a DCP metadata dataclass NEWOBJ may create.
        needs_machine: ``call`` takes the machine first (to charge work or check keys).
        cost: units of work charged per call beyond its arguments' sizes (an object much
            larger than the bytes that ask for it, such as a tensor, costs more).
    """

    def __init__(
        self,
        name: str,
        call: Callable[..., Any] | None = None,
        cls: type | None = None,
        needs_machine: bool = False,
        cost: int = 0,
    ) -> None:
        self.name, self.call, self.cls, self.needs_machine = name, call, cls, needs_machine
        self.cost = cost


_CALLABLES: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): size_of,
    ("torch.serialization", "_get_layout"): layout_of,
    ("pathlib", "PosixPath"): _path(pathlib.PurePosixPath),
    ("pathlib", "PurePosixPath"): _path(pathlib.PurePosixPath),
    ("pathlib", "WindowsPath"): _path(pathlib.PureWindowsPath),
    ("pathlib", "PureWindowsPath"): _path(pathlib.PureWindowsPath),
    (_dcp_md.__name__, "_MEM_FORMAT_ENCODING"): _mem_format,
}


def _resolve(module: str, name: str) -> Any:
    """An allowed global, or raises; nothing is imported. See [Note: Allow-list unpickling]."""
    key = (module, name)
    if key in _CALLABLES:
        return Global(f"{module}.{name}", call=_CALLABLES[key])
    if key in DATACLASSES:
        return Global(f"{module}.{name}", cls=DATACLASSES[key])
    # vars(), not getattr(): torch's module __getattr__ imports submodules on demand
    value = vars(torch).get(name) if module == "torch" else None
    if isinstance(value, (torch.dtype, torch.layout)):
        return value
    raise UnsafePickleError(
        f"global {describe(f'{module}.{name}')} is not allowed (only DCP's metadata "
        f"classes, torch dtypes, layouts and Size, and plain containers and scalars may appear)"
    )


def _build(m: _Machine, obj: Any, state: Any) -> None:
    cls = type(obj)
    if cls not in DATACLASSES.values():
        raise UnsafePickleError(f"BUILD on a {cls.__name__} is not allowed")
    if id(obj) in m.built:  # a second BUILD could change a dict key after it was hashed
        raise UnsafePickleError(f"BUILD twice on the same {cls.__name__}")
    m.built.add(id(obj))
    slots = None
    if type(state) is tuple and len(state) == 2 and type(state[1]) is dict:
        state, slots = state
    if cls.__name__ == "TensorProperties":
        if not (
            type(state) is tuple
            and len(state) == 5
            and isinstance(state[0], torch.dtype)
            and isinstance(state[1], torch.layout)
            and type(state[2]) is bool
            and _MEM_FORMAT is not None
            and isinstance(state[3], _MEM_FORMAT)
            and type(state[4]) is bool
        ):
            raise UnsafePickleError(f"bad TensorProperties state {describe(state)}")
        obj.__setstate__(state)
        return
    fields = {f.name for f in dataclasses.fields(obj)}
    for part in (state, slots):
        if part is None:
            continue
        if type(part) is not dict:
            raise UnsafePickleError(f"bad state for {cls.__name__}: {describe(part, 4)}")
        unknown = [k for k in part if not (type(k) is str and k in fields)]
        if unknown:
            names = ", ".join(describe(k) for k in unknown[:3])
            raise UnsafePickleError(
                f"bad state for {cls.__name__}: unknown field(s) {names} (fields are "
                f"{sorted(fields)})"
            )
        obj.__dict__.update(part)
    if cls is MetadataIndex:
        _check_index(obj)


def _check_index(ix: Any) -> None:
    """A ``MetadataIndex`` hashes and compares as ``(fqn, offset)``: both must be flat."""
    fqn, offset, index = (ix.__dict__.get(n) for n in ("fqn", "offset", "index"))
    if (
        type(fqn) is not str
        or not (
            offset is None or (type(offset) is torch.Size and all(_is_index(d) for d in offset))
        )
        or not (index is None or type(index) is int)
    ):
        raise UnsafePickleError(
            f"bad MetadataIndex: fqn {describe(fqn)}, offset {describe(offset)}, "
            f"index {describe(index)}"
        )


def _key_cost(k: Any, op: str) -> int:
    """The work of hashing ``k`` once, if it is flat: see [Note: Bounded work on untrusted
    input]."""
    if type(k) in _FLAT_KEYS:
        return 1
    if type(k) is torch.Size:  # non-negative ints (size_of)
        return 1 + len(k)
    if type(k) is MetadataIndex and "fqn" in k.__dict__:  # checked by BUILD (_check_index)
        offset = k.__dict__.get("offset")
        return 2 + (0 if offset is None else len(offset))
    if type(k) is tuple and all(type(x) in _FLAT_KEYS for x in k):
        return 1 + len(k)
    raise UnsafePickleError(
        f"{op}: a key of type {type(k).__name__} is not allowed (dict keys and set items must "
        f"be strs, bytes, numbers, None, dtypes, torch.Size, DCP MetadataIndex or flat tuples "
        f"of those: hashing a nested key could walk a 'billion laughs' structure)"
    )


_MAX_LINE = 1 << 16
MAX_SHARED_HASH = 16
"""The most keys of one dict or set that may share one hash value (see [Note: Hash flooding])."""
_DICTS = (dict, OrderedDict)

# [Note: Hash flooding]
# Python randomises the hashes of strs and bytes, but not of ints, floats or tuples of them:
# ``1 + k * (2**61 - 1)`` hashes to 1 for every k, so a dict built from 60,000 such keys (780 KB
# of pickle) probes every earlier key at each insert, quadratic work (no answer in 20 s). The
# unpickler counts, per container, the keys sharing each hash value and refuses the
# (MAX_SHARED_HASH + 1)-th: an insert then compares at most MAX_SHARED_HASH keys, and the
# counters themselves are keyed by the hash values, ints below 2**61 that hash to themselves
# (distinct values never collide there). Real state never has two keys of one hash.


class _Machine:
    def __init__(
        self,
        data: bytes,
        resolve: Callable[[str, str], Any],
        persistent: Callable[[Any], Any] | None,
    ) -> None:
        self.raw = bytes(data)
        self.data = memoryview(self.raw)
        self.pos = 0
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.built: set[int] = set()
        self.resolve = resolve
        self.persistent = persistent
        self.work = 0
        self.budget = work_budget(len(self.raw))
        self.shared: dict[int, dict[int, int]] = {}  # id(container) -> {hash: keys}

    def charge(self, units: int, op: str) -> None:
        """Counts work beyond one step per opcode; refuses past the budget (see [Note: Bounded
        work on untrusted input])."""
        self.work += units
        if self.work > self.budget:
            raise UnsafePickleError(
                f"{op} at offset {self.pos}: the pickle asks for more than {self.budget} units "
                f"of work ({len(self.raw)} bytes may ask for 64 per byte): a structure built to "
                f"explode"
            )

    def key(self, container: object, k: Any, op: str) -> Any:
        """``k`` as a key of ``container`` if it is flat and fewer than MAX_SHARED_HASH other
        keys share its hash (see [Note: Hash flooding])."""
        self.charge(_key_cost(k, op), op)
        h = hash(k)
        counts = self.shared.setdefault(id(container), {})
        n = counts.get(h, 0) + 1
        if n > MAX_SHARED_HASH:
            raise UnsafePickleError(
                f"{op} at offset {self.pos}: more than {MAX_SHARED_HASH} keys of one container "
                f"share a hash value (hash flooding)"
            )
        counts[h] = n
        return k

    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise UnsafePickleError(
                f"truncated pickle: {n} bytes wanted at offset {self.pos} of {len(self.data)}"
            )
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def line(self) -> bytes:
        # find() within the bounds: a copy of the next 64 KiB per opcode would make a file of
        # short text opcodes cost quadratic time
        end = self.raw.find(b"\n", self.pos, self.pos + _MAX_LINE)
        if end < 0:
            raise UnsafePickleError(f"unterminated line at offset {self.pos}")
        return self.read(end - self.pos + 1)[:-1]

    def uint(self, n: int) -> int:
        return int.from_bytes(self.read(n), "little")

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise UnsafePickleError(f"no MARK before offset {self.pos}")
        items = self.stack
        self.stack = self.marks.pop()
        return items

    def pop(self) -> Any:
        if not self.stack:
            raise UnsafePickleError(f"stack underflow at offset {self.pos}")
        return self.stack.pop()

    def top(self, kind: type | tuple[type, ...], op: str) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not self.stack or not (object in kinds or type(self.stack[-1]) in kinds):
            raise UnsafePickleError(f"{op} at offset {self.pos} applies only to {kind}")
        return self.stack[-1]

    def run(self) -> Any:
        raw, size, ops = self.raw, len(self.raw), _OPS_BY_CODE
        while True:
            at = self.pos
            if at >= size:
                raise UnsafePickleError(f"truncated pickle: no STOP before offset {at}")
            self.pos = at + 1
            handler = ops.get(raw[at])  # an int: no bytes object per opcode
            if handler is None:
                raise UnsafePickleError(
                    f"pickle opcode {bytes([raw[at]])!r} at offset {at} is not allowed"
                )
            if handler(self) is True:
                if not self.stack:
                    raise UnsafePickleError("malformed pickle: STOP with an empty stack")
                return self.stack[-1]


def _op_global(m: _Machine) -> None:
    module, name = m.line().decode("utf-8"), m.line().decode("utf-8")
    m.stack.append(m.resolve(module, name))


def _op_stack_global(m: _Machine) -> None:
    name, module = m.pop(), m.pop()
    if type(module) is not str or type(name) is not str:
        raise UnsafePickleError("STACK_GLOBAL needs two strs")
    m.stack.append(m.resolve(module, name))


def _name(v: Any) -> str:
    return v.name if isinstance(v, Global) else type(v).__name__


def _op_reduce(m: _Machine) -> None:
    args, fn = m.pop(), m.pop()
    if not isinstance(fn, Global) or fn.call is None or type(args) is not tuple:
        raise UnsafePickleError(f"REDUCE of {_name(fn)} is not allowed")
    # an allowed callable's work is that of its arguments: charged before it runs, so a few
    # bytes calling it again and again on one shared list cannot cost seconds
    m.charge(1 + fn.cost + sum(len(a) for a in args if isinstance(a, _SIZED)), fn.name)
    m.stack.append(fn.call(m, *args) if fn.needs_machine else fn.call(*args))


_SIZED = (str, bytes, bytearray, tuple, list, dict, set, frozenset)


def _op_binpersid(m: _Machine) -> None:
    pid = m.pop()
    if m.persistent is None:
        raise UnsafePickleError(f"persistent id at offset {m.pos} is not allowed")
    m.stack.append(m.persistent(pid))


def _op_newobj(m: _Machine) -> None:
    args, cls = m.pop(), m.pop()
    if not isinstance(cls, Global) or cls.cls is None or type(args) is not tuple or args:
        raise UnsafePickleError(f"NEWOBJ of {_name(cls)} with {describe(args)} is not allowed")
    m.stack.append(object.__new__(cls.cls))


def _op_build(m: _Machine) -> None:
    state = m.pop()
    _build(m, m.top(tuple(DATACLASSES.values()), "BUILD"), state)


def _op_setitems(m: _Machine) -> None:
    items = m.pop_mark()
    d = m.top(_DICTS, "SETITEMS")
    if len(items) % 2:
        raise UnsafePickleError("SETITEMS with an odd number of items")
    for i in range(0, len(items), 2):
        d[m.key(d, items[i], "SETITEMS")] = items[i + 1]


def _op_setitem(m: _Machine) -> None:
    v, k = m.pop(), m.pop()
    d = m.top(_DICTS, "SETITEM")
    d[m.key(d, k, "SETITEM")] = v


def _op_dict(m: _Machine) -> None:
    items = m.pop_mark()
    if len(items) % 2:
        raise UnsafePickleError("DICT with an odd number of items")
    d: dict[Any, Any] = {}
    for i in range(0, len(items), 2):
        d[m.key(d, items[i], "DICT")] = items[i + 1]
    m.stack.append(d)


def _push(value: Callable[[_Machine], Any]) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        v = value(m)  # first: it may pop a mark, which replaces m.stack
        m.stack.append(v)

    return op


def _memo_put(key: Callable[[_Machine], int]) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        k = key(m)
        if not m.stack:
            raise UnsafePickleError("memo PUT with an empty stack")
        m.memo[k] = m.stack[-1]

    return op


def _memo_get(key: Callable[[_Machine], int]) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        k = key(m)
        if k not in m.memo:
            raise UnsafePickleError(f"memo key {k} is not defined")
        m.stack.append(m.memo[k])

    return op


def _line_int(m: _Machine) -> int:
    text = m.line().rstrip(b"L")
    if text == b"00":
        return False
    if text == b"01":
        return True
    if len(text) > 4300:
        raise UnsafePickleError("integer literal too long")
    try:
        return int(text)
    except ValueError:
        raise UnsafePickleError(f"bad integer literal {text[:40]!r}") from None


def _sized(width: int, kind: str) -> Callable[[_Machine], Any]:
    def read(m: _Machine) -> Any:
        raw = m.read(m.uint(width))
        if kind == "str":
            try:
                return raw.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise UnsafePickleError("bad UTF-8 in a pickled str") from None
        if kind == "long":
            return int.from_bytes(raw, "little", signed=True)
        return raw

    return read


def _float_line(m: _Machine) -> float:
    try:
        return float(m.line())
    except ValueError:
        raise UnsafePickleError("bad float literal") from None


def _appends(m: _Machine) -> None:
    items = m.pop_mark()
    m.top(list, "APPENDS").extend(items)


def _additems(m: _Machine) -> None:
    items = m.pop_mark()
    s = m.top(set, "ADDITEMS")
    s.update(m.key(s, k, "ADDITEMS") for k in items)


def flat_set(m: _Machine, items: Any, op: str) -> set[Any]:
    """A set of ``items`` (an iterable the machine built), each a flat key (see [Note: Hash
    flooding])."""
    out: set[Any] = set()
    out.update(m.key(out, k, op) for k in items)
    return out


def _frozenset(m: _Machine) -> frozenset[Any]:
    return frozenset(flat_set(m, m.pop_mark(), "FROZENSET"))


def _tuple_n(n: int) -> Callable[[_Machine], None]:
    def op(m: _Machine) -> None:
        if len(m.stack) < n:
            raise UnsafePickleError("stack underflow in TUPLE")
        items = tuple(m.stack[len(m.stack) - n :])
        del m.stack[len(m.stack) - n :]
        m.stack.append(items)

    return op


def _stop(m: _Machine) -> bool:
    return True


def _pop(m: _Machine) -> None:
    if m.stack or not m.marks:
        m.pop()
    else:
        m.pop_mark()


def _pop_mark(m: _Machine) -> None:
    m.pop_mark()


def _dup(m: _Machine) -> None:
    m.stack.append(m.top(object, "DUP") if m.stack else m.pop())


def _append(m: _Machine) -> None:
    value = m.pop()
    m.top(list, "APPEND").append(value)


def _mark(m: _Machine) -> None:
    m.marks.append(m.stack)
    m.stack = []


def _proto(m: _Machine) -> None:
    if m.uint(1) > 5:
        raise UnsafePickleError("unsupported pickle protocol")


def _frame(m: _Machine) -> None:
    if m.uint(8) > len(m.data):
        raise UnsafePickleError("pickle frame longer than the file")


def _unicode_line(m: _Machine) -> str:
    try:
        return codecs.decode(m.line(), "raw-unicode-escape")
    except UnicodeDecodeError:
        raise UnsafePickleError("bad UNICODE literal") from None


_OPS: dict[bytes, Callable[[_Machine], Any]] = {
    b"\x80": _proto,
    b"\x95": _frame,
    b".": _stop,
    b"(": _mark,
    b"0": _pop,
    b"1": _pop_mark,
    b"2": _dup,
    b"N": _push(lambda m: None),
    b"\x88": _push(lambda m: True),
    b"\x89": _push(lambda m: False),
    b"I": _push(_line_int),
    b"L": _push(_line_int),
    b"J": _push(lambda m: struct.unpack("<i", m.read(4))[0]),
    b"K": _push(lambda m: m.uint(1)),
    b"M": _push(lambda m: m.uint(2)),
    b"\x8a": _push(_sized(1, "long")),
    b"\x8b": _push(_sized(4, "long")),
    b"G": _push(lambda m: struct.unpack(">d", m.read(8))[0]),
    b"F": _push(_float_line),
    b"X": _push(_sized(4, "str")),
    b"\x8c": _push(_sized(1, "str")),
    b"\x8d": _push(_sized(8, "str")),
    b"V": _push(_unicode_line),
    b"B": _push(_sized(4, "bytes")),
    b"C": _push(_sized(1, "bytes")),
    b"\x8e": _push(_sized(8, "bytes")),
    b"]": _push(lambda m: []),
    b"a": _append,
    b"e": _appends,
    b"l": _push(lambda m: list(m.pop_mark())),
    b")": _push(lambda m: ()),
    b"t": _push(lambda m: tuple(m.pop_mark())),
    b"\x85": _tuple_n(1),
    b"\x86": _tuple_n(2),
    b"\x87": _tuple_n(3),
    b"}": _push(lambda m: {}),
    b"d": _op_dict,
    b"s": _op_setitem,
    b"u": _op_setitems,
    b"\x8f": _push(lambda m: set()),
    b"\x90": _additems,
    b"\x91": _push(_frozenset),
    b"c": _op_global,
    b"\x93": _op_stack_global,
    b"R": _op_reduce,
    b"Q": _op_binpersid,
    b"\x81": _op_newobj,
    b"b": _op_build,
    b"p": _memo_put(_line_int),
    b"q": _memo_put(lambda m: m.uint(1)),
    b"r": _memo_put(lambda m: m.uint(4)),
    b"\x94": _memo_put(lambda m: len(m.memo)),
    b"g": _memo_get(_line_int),
    b"h": _memo_get(lambda m: m.uint(1)),
    b"j": _memo_get(lambda m: m.uint(4)),
}


def work_budget(nbytes: int) -> int:
    """The work a pickle of ``nbytes`` bytes may ask for beyond one step per opcode: 64 units
    per byte, and at least 2**20 (see [Note: Bounded work on untrusted input])."""
    return max(1 << 20, 64 * nbytes)


def restricted_loads(
    data: bytes,
    what: str,
    *,
    resolve: Callable[[str, str], Any] | None = None,
    persistent: Callable[[Any], Any] | None = None,
) -> Any:
    """Unpickles ``data`` through the allow-list. See [Note: Allow-list unpickling].

    Args:
        data: the whole pickle.
        what: names the file in error messages.
        resolve: ``(module, name) -> allowed value or Global``, raising for anything else; by
            default DCP metadata's table.
        persistent: what a persistent id (``BINPERSID``) stands for; by default refused.

    Raises:
        UnsafePickleError: a global outside the allow-list, a disallowed opcode, or a
            malformed pickle (raised before any disallowed object is built).
    """
    # The cyclic garbage collector would traverse everything built so far each time enough
    # containers are allocated, doubling the cost of a file of many small containers: it is
    # paused while the machine runs (what it builds stays reachable until it returns).
    paused = gc.isenabled()
    gc.disable()
    try:
        return _Machine(data, resolve or _resolve, persistent).run()
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{what}: {e}") from None
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, RecursionError) as e:
        # e.g. a constructor's own check. Only a plain-text message is quoted: a KeyError's
        # str() is the repr() of its key (see [Note: Bounded work on untrusted input]).
        text = e.args[0][:200] if len(e.args) == 1 and type(e.args[0]) is str else ""
        raise UnsafePickleError(
            f"{what}: malformed pickle ({type(e).__name__}{': ' if text else ''}{text})"
        ) from None
    finally:
        if paused:
            gc.enable()


_OPS_BY_CODE: dict[int, Callable[[_Machine], Any]] = {code[0]: op for code, op in _OPS.items()}
