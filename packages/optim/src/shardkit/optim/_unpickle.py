"""An allow-list unpickler for the metadata of torch.distributed.checkpoint (DCP).

[Note: Allow-list unpickling]
DCP writes its ``.metadata`` with ``pickle.dump`` and reads it with ``pickle.load``, so a
crafted file runs code on load. ``restricted_loads`` reads it the way torch's weights-only
loader (``torch/_weights_only_unpickler.py``) reads ``torch.load`` files: a small interpreter
of pickle's opcodes written here, in Python, that

- knows only the data opcodes (constants, lists, tuples, dicts, sets, the memo, frames) and
  ``GLOBAL`` / ``STACK_GLOBAL`` / ``REDUCE`` / ``NEWOBJ`` / ``BUILD``; anything else (``INST``,
  ``OBJ``, extensions, persistent ids, out-of-band buffers) raises at its byte offset;
- resolves a global only from the table ``_GLOBALS`` (DCP's metadata classes, torch dtypes,
  layouts, ``torch.Size``, pure paths), *before* importing or building anything: a global
  outside it raises naming it, so no object of an unknown class is ever created;
- never calls the resolved globals directly: each entry of the table is a constructor written
  here that checks its arguments (``torch.Size`` of non-negative ints, a memory-format enum of
  a known value, ...), and ``BUILD`` of a metadata dataclass only sets its declared fields;
- keeps the memo in a dict and reads from a bytes buffer, so a crafted length or memo index
  cannot make it allocate more than the size of the file.

The result is then checked field by field (``_safe_reader.validate_metadata``). The table names
one private torch class, ``torch.distributed.checkpoint.filesystem._StorageInfo`` (what DCP's
file system storage writes per item) and the pickled name of
``torch.serialization._get_layout`` (never called); ``tests/test_checkpoint_safety.py::
test_metadata_pin`` pins that real DCP metadata reads back equal through this path.
"""

from __future__ import annotations

import codecs
import dataclasses
import enum
import pathlib
import struct
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as _dcp_fs
import torch.distributed.checkpoint.metadata as _dcp_md

__all__: list[str] = []


class UnsafePickleError(ValueError):
    """A pickle holds something outside the allow-list, or is malformed."""


def _dataclasses() -> dict[tuple[str, str], type]:
    out: dict[tuple[str, str], type] = {}
    for module, names in (
        (
            _dcp_md,
            (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "StorageMeta",
                "MetadataIndex",
            ),
        ),
        (_dcp_fs, ("_StorageInfo",)),
    ):
        for name in names:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and dataclasses.is_dataclass(cls):
                out[(module.__name__, name)] = cls
    return out


_DATACLASSES = _dataclasses()
_MEM_FORMAT: type[enum.Enum] | None = getattr(_dcp_md, "_MEM_FORMAT_ENCODING", None)


def _is_index(v: object) -> bool:
    return type(v) is int and v >= 0


def _size(*args: Any) -> torch.Size:
    if len(args) > 1 or (args and not isinstance(args[0], (tuple, list))):
        raise UnsafePickleError(f"torch.Size expects one tuple of ints, got {args!r:.100}")
    dims = tuple(args[0]) if args else ()
    if not all(_is_index(d) for d in dims):
        raise UnsafePickleError(f"torch.Size dims must be non-negative ints, got {dims!r:.100}")
    return torch.Size(dims)


def _layout(*args: Any) -> torch.layout:
    name = args[0] if len(args) == 1 else None
    value = (
        getattr(torch, name[6:], None) if isinstance(name, str) and name[:6] == "torch." else None
    )
    if not isinstance(value, torch.layout):
        raise UnsafePickleError(f"unknown torch layout {args!r:.100}")
    return value


def _mem_format(*args: Any) -> enum.Enum:
    if _MEM_FORMAT is None or len(args) != 1 or type(args[0]) is not int:
        raise UnsafePickleError(f"bad memory format encoding {args!r:.100}")
    try:
        return _MEM_FORMAT(args[0])
    except ValueError:
        raise UnsafePickleError(f"unknown memory format encoding {args[0]!r}") from None


def _path(kind: type[pathlib.PurePath]) -> Callable[..., pathlib.PurePath]:
    def make(*args: Any) -> pathlib.PurePath:
        if not all(type(a) is str for a in args):
            raise UnsafePickleError(f"a path's parts must be strs, got {args!r:.100}")
        return kind(*args)

    return make


class _Global:
    """A resolved allowed global: a safe constructor (REDUCE), a class (NEWOBJ) or a value."""

    def __init__(
        self, name: str, call: Callable[..., Any] | None = None, cls: type | None = None
    ) -> None:
        self.name, self.call, self.cls = name, call, cls


_CALLABLES: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
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
        return _Global(f"{module}.{name}", call=_CALLABLES[key])
    if key in _DATACLASSES:
        return _Global(f"{module}.{name}", cls=_DATACLASSES[key])
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
        return getattr(torch, name)
    raise UnsafePickleError(
        f"global {module}.{name} is not allowed (only DCP's metadata classes, torch dtypes, "
        f"layouts and Size, and plain containers and scalars may appear)"
    )


def _build(obj: Any, state: Any) -> None:
    cls = type(obj)
    if cls not in _DATACLASSES.values():
        raise UnsafePickleError(f"BUILD on a {cls.__name__} is not allowed")
    slots = None
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state, slots = state
    if cls.__name__ == "TensorProperties":
        if not (
            isinstance(state, tuple)
            and len(state) == 5
            and isinstance(state[0], torch.dtype)
            and isinstance(state[1], torch.layout)
            and type(state[2]) is bool
            and _MEM_FORMAT is not None
            and isinstance(state[3], _MEM_FORMAT)
            and type(state[4]) is bool
        ):
            raise UnsafePickleError(f"bad TensorProperties state {state!r:.200}")
        obj.__setstate__(state)
        return
    fields = {f.name for f in dataclasses.fields(obj)}
    for part in (state, slots):
        if part is None:
            continue
        if not isinstance(part, dict) or not all(k in fields for k in part):
            raise UnsafePickleError(
                f"bad state for {cls.__name__}: {part!r:.200} (fields are {sorted(fields)})"
            )
        obj.__dict__.update(part)


_MAX_LINE = 1 << 16


class _Machine:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}

    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise UnsafePickleError(
                f"truncated pickle: {n} bytes wanted at offset {self.pos} of {len(self.data)}"
            )
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def line(self) -> bytes:
        end = bytes(self.data[self.pos : self.pos + _MAX_LINE]).find(b"\n")
        if end < 0:
            raise UnsafePickleError(f"unterminated line at offset {self.pos}")
        return self.read(end + 1)[:-1]

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
        while True:
            at = self.pos
            op = self.read(1)
            handler = _OPS.get(op)
            if handler is None:
                raise UnsafePickleError(f"pickle opcode {op!r} at offset {at} is not allowed")
            if handler(self) is True:
                if not self.stack:
                    raise UnsafePickleError("malformed pickle: STOP with an empty stack")
                return self.stack[-1]


def _op_global(m: _Machine) -> None:
    module, name = m.line().decode("utf-8"), m.line().decode("utf-8")
    m.stack.append(_resolve(module, name))


def _op_stack_global(m: _Machine) -> None:
    name, module = m.pop(), m.pop()
    if type(module) is not str or type(name) is not str:
        raise UnsafePickleError("STACK_GLOBAL needs two strs")
    m.stack.append(_resolve(module, name))


def _op_reduce(m: _Machine) -> None:
    args, fn = m.pop(), m.pop()
    if not isinstance(fn, _Global) or fn.call is None or type(args) is not tuple:
        raise UnsafePickleError(f"REDUCE of {fn!r:.100} is not allowed")
    m.stack.append(fn.call(*args))


def _op_newobj(m: _Machine) -> None:
    args, cls = m.pop(), m.pop()
    if not isinstance(cls, _Global) or cls.cls is None or args != ():
        raise UnsafePickleError(f"NEWOBJ of {cls!r:.100} with {args!r:.100} is not allowed")
    m.stack.append(object.__new__(cls.cls))


def _op_build(m: _Machine) -> None:
    state = m.pop()
    _build(m.top(tuple(_DATACLASSES.values()), "BUILD"), state)


def _op_setitems(m: _Machine) -> None:
    items = m.pop_mark()
    d = m.top(dict, "SETITEMS")
    if len(items) % 2:
        raise UnsafePickleError("SETITEMS with an odd number of items")
    for i in range(0, len(items), 2):
        d[items[i]] = items[i + 1]


def _op_setitem(m: _Machine) -> None:
    v, k = m.pop(), m.pop()
    m.top(dict, "SETITEM")[k] = v


def _op_dict(m: _Machine) -> None:
    items = m.pop_mark()
    if len(items) % 2:
        raise UnsafePickleError("DICT with an odd number of items")
    m.stack.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})


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
    m.top(set, "ADDITEMS").update(items)


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
    b"\x91": _push(lambda m: frozenset(m.pop_mark())),
    b"c": _op_global,
    b"\x93": _op_stack_global,
    b"R": _op_reduce,
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


def restricted_loads(data: bytes, what: str) -> Any:
    """Unpickles ``data`` through the allow-list. See [Note: Allow-list unpickling].

    Args:
        data: the whole pickle.
        what: names the file in error messages.

    Raises:
        UnsafePickleError: a global outside the allow-list, a disallowed opcode, or a
            malformed pickle (raised before any disallowed object is built).
    """
    try:
        return _Machine(data).run()
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{what}: {e}") from None
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, RecursionError) as e:
        # e.g. an unhashable dict key, a dataclass field of the wrong type
        raise UnsafePickleError(f"{what}: malformed pickle ({type(e).__name__}: {e})") from None
