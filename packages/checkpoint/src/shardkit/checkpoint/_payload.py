"""Stored items decoded as data: ``torch.save`` blobs read here, never by ``torch.load``.

[Note: One decoder for stored items]
DCP stores every tensor chunk and every non-tensor value as a ``torch.save`` blob: a zip of
uncompressed records, one ``data.pkl`` (the pickle of the value) and one record per storage.
``torch.load`` decides how to read a blob from its first bytes (a zip, or the legacy format)
while a zip reader finds the zip from its end, so a blob can hold two meanings; its
weights-only unpickler calls allowed callables (``bytearray``, ``_codecs.encode``, ``set``)
with any arguments, and hashes any int keys. A safe load therefore never hands a stored blob to
``torch.load``: :func:`decode_blob` reads it, once, as

- exactly one zip starting at offset 0 and ending at the blob's end (its end-of-directory record
  last, no comment), of uncompressed records that lie inside the blob, do not overlap, and sit
  under one archive folder with one ``data.pkl``;
- a pickle run by the allow-list machine of ``_unpickle.py`` (bounded work, flat keys, hash
  flooding refused: [Note: Bounded work on untrusted input], [Note: Hash flooding]) with the
  table :data:`PAYLOAD_GLOBALS`: plain containers, ``OrderedDict``, ``set``, ``complex``,
  ``bytes`` (``_codecs.encode`` of a str, latin-1 only),
  ``bytearray`` of bytes (never of a count), ``torch.Size``, dtypes, devices, layouts and
  tensors (``_rebuild_tensor_v2`` / ``_rebuild_parameter`` over a storage of the blob, every
  view checked to lie inside its storage);
- tensors as views of the blob's own bytes (``torch.frombuffer``): the bytes that were
  checksummed are the bytes that are decoded, and nothing is allocated beyond the blob.

A non-tensor value is then handed to DCP's planner as a ``torch.save`` of the decoded value:
bytes shardkit wrote itself from plain data, which any planner's ``torch.load`` reads back equal.
"""

from __future__ import annotations

import io
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import torch
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import UnsafeCheckpointError
from shardkit.checkpoint._unpickle import (
    Global,
    UnsafePickleError,
    flat_set,
    layout_of,
    restricted_loads,
    size_of,
)

__all__ = ["PAYLOAD_GLOBALS", "Records", "decode_blob", "read_records"]

_LOCAL = struct.Struct("<4s5H3I2H")  # a zip local file header (30 bytes)
_EOCD = b"PK\x05\x06"
_MAX_PICKLE_TENSOR = 1 << 16  # a tensor's data.pkl is ~200 bytes plus ~12 per dimension
_MAX_DIMS = 1024


def _fail(what: str, message: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{what}: {message}; the checkpoint is damaged or crafted")


@dataclass(frozen=True)
class Records:
    """Where the records of one ``torch.save`` zip lie in its blob."""

    pickle: tuple[int, int]
    """``(offset, size)`` of ``data.pkl``."""
    storages: dict[str, tuple[int, int]]
    """``(offset, size)`` of each storage record by key (``"0"`` for ``<archive>/data/0``)."""
    byteorder: tuple[int, int] | None
    """``(offset, size)`` of the ``byteorder`` record, when there is one."""


def read_records(f: IO[bytes], length: int, what: str) -> Records:
    """The records of the ``torch.save`` zip ``f`` (``length`` bytes, seekable), checked as
    [Note: One decoder for stored items] says. Reads only headers.

    Raises:
        UnsafeCheckpointError: anything but one plain zip of uncompressed records filling
            exactly the blob.
    """
    f.seek(0)
    head = f.read(4)
    f.seek(max(length - 22, 0))
    tail = f.read(22)
    if head != b"PK\x03\x04" or len(tail) != 22 or tail[:4] != _EOCD or tail[20:22] != b"\0\0":
        raise _fail(
            what,
            "its bytes are not one torch.save zip from their first byte to their last (a legacy "
            "or prefixed blob, or trailing bytes, would be read differently by torch.load)",
        )
    entries = _central_directory(f, length, what)
    spans: list[tuple[int, int, str]] = []
    for name, header, size in entries:
        f.seek(header)
        raw = f.read(_LOCAL.size)
        if len(raw) != _LOCAL.size:
            raise _fail(what, f"its record {describe(name)} lies outside it")
        sig, _, _, _, _, _, _, _, _, nlen, elen = _LOCAL.unpack(raw)
        local_name = f.read(nlen)
        start = header + _LOCAL.size + nlen + elen
        if sig != b"PK\x03\x04" or local_name != name.encode("utf-8", "surrogateescape"):
            raise _fail(what, f"its record {describe(name)} has no matching header")
        if start + size > length:
            raise _fail(what, f"its record {describe(name)} lies outside it")
        spans.append((header, start + size, name))
    spans.sort()
    sizes = {name: size for name, _, size in entries}
    if not spans or spans[0][0] != 0:
        raise _fail(what, "its first record does not start at its first byte")
    for (_, end, name), (nxt, _, _) in zip(spans, spans[1:]):
        if nxt < end:
            raise _fail(what, f"its record {describe(name)} overlaps the next")
    archive = spans[0][2].split("/", 1)[0]
    pickle: tuple[int, int] | None = None
    byteorder: tuple[int, int] | None = None
    storages: dict[str, tuple[int, int]] = {}
    names: set[str] = set()
    for header, end, name in spans:
        if name in names or not name.startswith(archive + "/"):
            raise _fail(what, f"its record {describe(name)} is repeated or outside its archive")
        names.add(name)
        rest = name[len(archive) + 1 :]
        size = sizes[name]
        span = (end - size, size)
        if rest == "data.pkl":
            pickle = span
        elif rest == "byteorder":
            byteorder = span
        elif rest.startswith("data/"):
            storages[rest[5:]] = span
    if pickle is None:
        raise _fail(what, "it holds no pickle (data.pkl)")
    return Records(pickle, storages, byteorder)


_EOCD_REC = struct.Struct("<4s4H2IH")
_Z64_LOCATOR = struct.Struct("<4sIQI")
_Z64_EOCD = struct.Struct("<4sQ2H2I4Q")
_CENTRAL = struct.Struct("<4s6H3I5H2I")


def _central_directory(f: IO[bytes], length: int, what: str) -> list[tuple[str, int, int]]:
    """``(name, local header offset, size)`` of every record of the zip, parsed here: its
    central directory must end right at its end records (ZIP64 ones included, as ``torch.save``
    writes them); a record whose sizes need ZIP64 extra fields (4 GiB and more) is read
    through ``zipfile``. Every record must be stored (uncompressed), unencrypted."""
    end = length - _EOCD_REC.size
    f.seek(end)
    _, disk, cd_disk, n_here, n_total, cd_size, cd_offset, _ = _EOCD_REC.unpack(
        f.read(_EOCD_REC.size)
    )
    locator = end - _Z64_LOCATOR.size
    if locator >= _Z64_EOCD.size:
        f.seek(locator)
        sig, _, z64_at, _ = _Z64_LOCATOR.unpack(f.read(_Z64_LOCATOR.size))
        if sig == b"PK\x06\x07":  # torch.save always writes the ZIP64 end records
            if z64_at != locator - _Z64_EOCD.size:
                raise _fail(what, "its ZIP64 end record is not where its locator says")
            f.seek(z64_at)
            z64 = _Z64_EOCD.unpack(f.read(_Z64_EOCD.size))
            if z64[0] != b"PK\x06\x06":
                raise _fail(what, "its ZIP64 end record is malformed")
            disk, cd_disk, n_here, n_total, cd_size, cd_offset = z64[4:10]
            end = z64_at
    if disk or cd_disk or n_here != n_total or cd_offset + cd_size != end:
        raise _fail(what, "its zip directory does not end at its end record")
    f.seek(cd_offset)
    raw = f.read(cd_size)
    out: list[tuple[str, int, int]] = []
    at = 0
    for _ in range(n_total):
        if at + _CENTRAL.size > len(raw):
            raise _fail(what, "its zip directory is truncated")
        fields = _CENTRAL.unpack_from(raw, at)
        sig, flags, method, csize, usize = fields[0], fields[3], fields[4], fields[8], fields[9]
        nlen, elen, clen, header = fields[10], fields[11], fields[12], fields[16]
        name = raw[at + _CENTRAL.size : at + _CENTRAL.size + nlen]
        at += _CENTRAL.size + nlen + elen + clen
        if sig != b"PK\x01\x02" or at > len(raw):
            raise _fail(what, "its zip directory is malformed")
        if 0xFFFFFFFF in (csize, usize, header):
            return _zipfile_directory(f, what)
        if method != zipfile.ZIP_STORED or flags & 0x1 or csize != usize:
            raise _fail(what, f"its record {describe(name)} is compressed or encrypted")
        text = name.decode("utf-8" if flags & 0x800 else "cp437", "surrogateescape")
        out.append((text, header, usize))
    if at != len(raw):
        raise _fail(what, "its zip directory holds bytes after its last record")
    return out


def _zipfile_directory(f: IO[bytes], what: str) -> list[tuple[str, int, int]]:
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, struct.error) as e:
        raise _fail(what, f"its zip directory is malformed ({type(e).__name__})") from None
    for info in infos:
        if (
            info.compress_type != zipfile.ZIP_STORED
            or info.flag_bits & 0x1
            or info.compress_size != info.file_size
        ):
            raise _fail(what, f"its record {describe(info.filename)} is compressed or encrypted")
    return [(info.filename, info.header_offset, info.file_size) for info in infos]


def _read(f: IO[bytes], span: tuple[int, int]) -> bytes:
    f.seek(span[0])
    return f.read(span[1])


# ---- the allow-list of a stored item's pickle -----------------------------------------------


_STORAGE_DTYPES: dict[tuple[str, str], torch.dtype] = {
    ("torch", "DoubleStorage"): torch.float64,
    ("torch", "FloatStorage"): torch.float32,
    ("torch", "HalfStorage"): torch.float16,
    ("torch", "BFloat16Storage"): torch.bfloat16,
    ("torch", "LongStorage"): torch.int64,
    ("torch", "IntStorage"): torch.int32,
    ("torch", "ShortStorage"): torch.int16,
    ("torch", "CharStorage"): torch.int8,
    ("torch", "ByteStorage"): torch.uint8,
    ("torch", "BoolStorage"): torch.bool,
    ("torch", "ComplexDoubleStorage"): torch.complex128,
    ("torch", "ComplexFloatStorage"): torch.complex64,
    ("torch", "UntypedStorage"): torch.uint8,
    ("torch.storage", "UntypedStorage"): torch.uint8,
}
"""The storage classes ``torch.save`` names in a persistent id, by the dtype of their elements
(``UntypedStorage``: bytes, with the tensor's dtype given to ``_rebuild_tensor_v3``)."""


class _StorageType:
    """A storage class named by a pickle: only its dtype is used (it is never called)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


@dataclass
class _Storage:
    """A storage record of the blob, as a tensor view of its bytes (``meta`` when checking)."""

    data: torch.Tensor
    dtype: torch.dtype
    numel: int


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if type(v) not in (tuple, list, torch.Size) or len(v) > _MAX_DIMS:
        raise UnsafePickleError(f"{what} must be a tuple of ints, got {describe(v)}")
    if not all(type(d) is int for d in v):
        raise UnsafePickleError(f"{what} must be a tuple of ints, got {describe(v)}")
    return tuple(v)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> torch.Tensor:
    if type(storage) is not _Storage or type(offset) is not int:
        raise UnsafePickleError(f"a tensor must be rebuilt from a storage, got {describe(storage)}")
    size, stride = _ints(size, "a tensor's size"), _ints(stride, "a tensor's stride")
    if len(size) != len(stride) or offset < 0 or any(d < 0 for d in (*size, *stride)):
        raise UnsafePickleError(f"bad tensor size {describe(size)} / stride {describe(stride)}")
    if not (len(rest) in (2, 3) and type(rest[0]) is bool):
        raise UnsafePickleError("a tensor's requires_grad must be a bool")
    extra = rest[2] if len(rest) == 3 else None
    if type(rest[1]) is not OrderedDict or rest[1] or not (extra is None or extra == {}):
        raise UnsafePickleError("a stored tensor must have no backward hooks or metadata")
    if 0 not in size:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= storage.numel:
            raise UnsafePickleError(
                f"a tensor view (offset {offset}, size {describe(size)}, stride "
                f"{describe(stride)}) reaches past its storage of {storage.numel} elements"
            )
    t = storage.data.as_strided(size, stride, offset)
    return t.requires_grad_(rest[0]) if rest[0] and t.is_floating_point() else t


def _rebuild_tensor_v3(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    *rest: Any,
) -> torch.Tensor:
    """``torch.save``'s form for dtypes without a typed storage class (float8, uint16, ...):
    an untyped (byte) storage viewed as ``dtype``."""
    if type(storage) is not _Storage or storage.dtype != torch.uint8:
        raise UnsafePickleError(f"a tensor must be rebuilt from a storage, got {describe(storage)}")
    if not isinstance(dtype, torch.dtype) or len(rest) > 1:
        raise UnsafePickleError(f"_rebuild_tensor_v3 of dtype {describe(dtype)} is not allowed")
    n = storage.numel // dtype.itemsize
    typed = _Storage(storage.data[: n * dtype.itemsize].view(dtype), dtype, n)
    return _rebuild_tensor(typed, offset, size, stride, requires_grad, hooks, *rest)


def _charged(rebuild: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``rebuild``, charging the view's elements beyond what its item's bytes hold as work: see
    [Note: An expanded view is work]."""

    def call(m: Any, *args: Any) -> torch.Tensor:
        t = rebuild(*args)
        # a storage record is a view of the item's bytes: what those bytes hold, at most
        backed = t.untyped_storage().nbytes() // max(t.element_size(), 1)
        m.charge(max(0, t.numel() - backed), "a tensor view")
        return t

    return call


# [Note: An expanded view is work]
# A stored tensor is a view of its storage record, and a view with a stride of 0 (what
# ``torch.save`` writes for an ``expand``-ed tensor) has as many elements as its size says over
# as few bytes as its storage has: a 1-element storage viewed as 2**40 elements is a dozen bytes
# of pickle, allocates nothing here, and then costs whoever touches it (a sum, a copy into a
# state dict) 2**40 steps. So the decoder charges a view's elements beyond what the stored item's
# bytes could hold (its storage records are views of those bytes) as work (the pickle's budget
# is 64 units per byte: [Note: Bounded work on untrusted input] in ``_unpickle.py``): an
# ``expand`` to a few times its storage, as models' buffers use (a ``(1, n)`` view of
# ``arange(n)`` has none beyond), loads; one that turns bytes into terabytes is refused.


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor) or type(requires_grad) is not bool:
        raise UnsafePickleError("a parameter must wrap a tensor")
    if type(hooks) is not OrderedDict or hooks:
        raise UnsafePickleError("a stored parameter must have no backward hooks")
    return torch.nn.Parameter(data, requires_grad)


def _encode(*args: Any) -> bytes:
    if len(args) != 2 or type(args[0]) is not str or args[1] not in ("latin1", "latin-1"):
        raise UnsafePickleError(
            f"_codecs.encode is allowed only as torch.save writes bytes (a str, 'latin1'), got "
            f"{describe(args)}"
        )
    try:
        return args[0].encode("latin1")
    except UnicodeEncodeError:
        raise UnsafePickleError("_codecs.encode of a str outside latin-1") from None


def _bytearray(*args: Any) -> bytearray:
    if len(args) > 1 or (args and type(args[0]) is not bytes):
        raise UnsafePickleError(
            f"bytearray is allowed only of bytes (never of a count), got {describe(args)}"
        )
    return bytearray(args[0] if args else b"")


def _set(kind: type) -> Callable[..., Any]:
    def make(m: Any, *args: Any) -> Any:
        if len(args) > 1 or (args and type(args[0]) not in (list, tuple)):
            raise UnsafePickleError(f"{kind.__name__} of {describe(args)} is not allowed")
        return kind(flat_set(m, args[0] if args else (), kind.__name__))

    return make


def _ordered_dict(m: Any, *args: Any) -> OrderedDict[Any, Any]:
    if len(args) > 1 or (args and type(args[0]) is not list):
        raise UnsafePickleError(f"OrderedDict of {describe(args)} is not allowed")
    out: OrderedDict[Any, Any] = OrderedDict()
    for pair in args[0] if args else ():
        if type(pair) not in (list, tuple) or len(pair) != 2:
            raise UnsafePickleError("OrderedDict items must be pairs")
        out[m.key(out, pair[0], "OrderedDict")] = pair[1]
    return out


def _number(v: Any) -> bool:
    return type(v) in (int, float, bool)


def _complex(*args: Any) -> complex:
    if not (1 <= len(args) <= 2 and all(_number(a) for a in args)):
        raise UnsafePickleError(f"complex of {describe(args)} is not allowed")
    return complex(*args)


def _device(*args: Any) -> torch.device:
    ok = 1 <= len(args) <= 2 and type(args[0]) is str and len(args[0]) <= 64
    if not ok or (len(args) == 2 and not (type(args[1]) is int and 0 <= args[1] < 1 << 16)):
        raise UnsafePickleError(f"torch.device of {describe(args)} is not allowed")
    try:
        return torch.device(*args)
    except RuntimeError:
        raise UnsafePickleError(f"torch.device of {describe(args)} is not a device") from None


_TABLE: tuple[tuple[tuple[str, str], Callable[..., Any], bool], ...] = (
    (("torch._utils", "_rebuild_tensor_v2"), _charged(_rebuild_tensor), True),
    (("torch._utils", "_rebuild_tensor_v3"), _charged(_rebuild_tensor_v3), True),
    (("torch._utils", "_rebuild_parameter"), _rebuild_parameter, False),
    (("collections", "OrderedDict"), _ordered_dict, True),
    (("_codecs", "encode"), _encode, False),
    (("torch", "Size"), size_of, False),
    (("torch", "device"), _device, False),
    (("torch.serialization", "_get_layout"), layout_of, False),
    *(
        ((module, name), call, machine)
        for module in ("builtins", "__builtin__")
        for name, call, machine in (
            ("set", _set(set), True),
            ("bytearray", _bytearray, False),
            ("complex", _complex, False),
        )
    ),
)
_TENSOR_COST = 2048
"""Work units charged per tensor a pickle builds: a tensor object takes a few hundred bytes of
memory however few bytes of pickle ask for it, so a pickle pays 32 of its bytes per tensor (at
64 units per byte); ``torch.save`` writes at least about 30 bytes for even a view of a shared
storage, and about 300 for a tensor with its own storage record."""
PAYLOAD_GLOBALS: dict[tuple[str, str], Global] = {
    key: Global(
        f"{key[0]}.{key[1]}",
        call,
        needs_machine=machine,
        cost=_TENSOR_COST if key[0] == "torch._utils" else 0,
    )
    for key, call, machine in _TABLE
}
"""``(module, name) -> Global``: what a stored item's pickle may name (besides dtypes, layouts
and storage classes of ``torch``). See [Note: One decoder for stored items]."""


def _resolve(module: str, name: str) -> Any:
    found = PAYLOAD_GLOBALS.get((module, name))
    if found is not None:
        return found
    value = vars(torch).get(name) if module == "torch" else None
    if isinstance(value, (torch.dtype, torch.layout)):
        return value
    if (module, name) in _STORAGE_DTYPES:
        return _StorageType(_STORAGE_DTYPES[(module, name)])
    raise UnsafePickleError(
        f"global {describe(f'{module}.{name}')} is not allowed in a stored item (shardkit's "
        f"allow-list, within torch's weights-only allow-list: plain containers and scalars, "
        f"bytes, torch dtypes, devices, Size and tensors); pass allow_pickle=True only for a "
        f"checkpoint you trust"
    )


@dataclass(frozen=True)
class _TensorSpec:
    """What a tensor chunk's pickle says: its one storage record and the view of it."""

    key: str
    storage_dtype: torch.dtype
    numel: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool


_SPECS: dict[bytes, _TensorSpec] = {}
_MAX_SPECS = 4096
_MAX_CACHED_PICKLE = 1024


def _tensor_spec(pkl: bytes, what: str) -> _TensorSpec:
    """The tensor a chunk's pickle rebuilds, decoded on the meta device through the allow-list.

    The pickles of the chunks of a checkpoint repeat (one per chunk shape), so small ones are
    remembered by their bytes (at most 4096 of at most 1 KiB): a checkpoint of many chunks runs
    the allow-list machine once per distinct pickle.
    """
    spec = _SPECS.get(pkl)
    if spec is not None:
        return spec
    named: list[tuple[str, torch.dtype, int]] = []

    def persistent(pid: Any) -> _Storage:
        key, dtype, numel = _storage_id(pid)
        if named and named[0] != (key, dtype, numel):
            raise UnsafePickleError("a tensor chunk's pickle names more than one storage")
        named.append((key, dtype, numel))
        return _Storage(torch.empty(numel, dtype=dtype, device="meta"), dtype, numel)

    try:
        t = restricted_loads(pkl, what, resolve=_resolve, persistent=persistent)
    except UnsafePickleError as e:
        raise UnsafeCheckpointError(f"{e}; the checkpoint is damaged or crafted") from None
    if type(t) is not torch.Tensor or not named:
        raise _fail(what, f"it holds {describe(t)} where a tensor chunk is stored")
    key, sdtype, numel = named[0]
    spec = _TensorSpec(
        key, sdtype, numel, t.dtype, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()),
        t.requires_grad,
    )  # fmt: skip
    if len(pkl) <= _MAX_CACHED_PICKLE:
        if len(_SPECS) >= _MAX_SPECS:
            _SPECS.clear()
        _SPECS[pkl] = spec
    return spec


def _storage_id(pid: Any) -> tuple[str, torch.dtype, int]:
    """``("storage", storage class, key, location, numel)``: torch.save's persistent id."""
    ok = type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"
    if not (ok and type(pid[1]) is _StorageType and type(pid[2]) is str and type(pid[4]) is int):
        raise UnsafePickleError(f"a storage named by {describe(pid)}, not torch.save's id")
    if pid[4] < 0:
        raise UnsafePickleError(f"a storage of {describe(pid[4])} elements")
    return pid[2], pid[1].dtype, pid[4]


def _span(key: str, dtype: torch.dtype, numel: int, records: Records) -> tuple[int, int]:
    """Where the storage record ``key`` lies; it must hold ``numel`` elements of ``dtype``."""
    span = records.storages.get(key)
    if span is None or numel * dtype.itemsize > span[1]:
        raise UnsafePickleError(
            f"its pickle declares a storage of {describe(numel)} {dtype} elements in record "
            f"{describe(key)}, which {'is absent' if span is None else f'has {span[1]} bytes'}"
        )
    return span


def _storage_data(
    blob: Any, dtype: torch.dtype, numel: int, offset: int, meta: bool
) -> torch.Tensor:
    """A storage record as a tensor: a view of the blob's bytes (on the meta device: nothing)."""
    if meta:
        return torch.empty(numel, dtype=dtype, device="meta")
    if numel:
        return torch.frombuffer(blob, dtype=dtype, count=numel, offset=offset)
    return torch.empty(0, dtype=dtype)


def _decode_tensor(
    blob: bytes | bytearray | IO[bytes], f: IO[bytes], records: Records, what: str, meta: bool
) -> torch.Tensor:
    if records.pickle[1] > _MAX_PICKLE_TENSOR:
        raise _fail(what, f"its pickle takes {records.pickle[1]} bytes, not a tensor's")
    spec = _tensor_spec(_read(f, records.pickle), what)
    try:
        span = _span(spec.key, spec.storage_dtype, spec.numel, records)
    except UnsafePickleError as e:
        raise _fail(what, str(e)) from None
    data = _storage_data(blob, spec.storage_dtype, spec.numel, span[0], meta)
    if spec.dtype != spec.storage_dtype:  # _rebuild_tensor_v3: bytes viewed as the dtype
        n = spec.numel // spec.dtype.itemsize
        data = data[: n * spec.dtype.itemsize].view(spec.dtype)
    t = data.as_strided(spec.size, spec.stride, spec.offset)
    return t.requires_grad_(True) if spec.requires_grad else t


def decode_blob(
    blob: bytes | bytearray | IO[bytes], length: int, what: str, *, tensor: bool, meta: bool = False
) -> Any:
    """The value a stored ``torch.save`` blob holds. See [Note: One decoder for stored items].

    Args:
        blob: the stored bytes (a ``bytearray`` shares its memory with the tensors returned), or
            a seekable file over them (then ``meta`` must be set: only headers and the pickle
            are read).
        length: the blob's size in bytes.
        what: names the item in errors.
        tensor: the item is a tensor chunk: its pickle must be one tensor and small.
        meta: check only: tensors are built on the meta device, storages are not read.

    Raises:
        UnsafeCheckpointError: the blob is not what a safe load accepts.
    """
    f: IO[bytes] = io.BytesIO(blob) if isinstance(blob, (bytes, bytearray)) else blob
    if not meta and not isinstance(blob, (bytes, bytearray)):
        raise TypeError("decode_blob: a file blob can only be checked (meta=True)")
    records = read_records(f, length, what)
    if records.byteorder is not None and _read(f, records.byteorder) != sys.byteorder.encode():
        raise _fail(what, f"it was written on a machine of another byte order than {sys.byteorder}")
    if tensor:
        return _decode_tensor(blob, f, records, what, meta)
    storages: dict[str, _Storage] = {}

    def persistent(pid: Any) -> _Storage:
        key, dtype, numel = _storage_id(pid)
        span = _span(key, dtype, numel, records)
        known = storages.get(key)
        if known is not None:
            if known.dtype != dtype or known.numel != numel:
                raise UnsafePickleError(f"storage {describe(key)} is named with two types")
            return known
        data = _storage_data(blob, dtype, numel, span[0], meta)
        storages[key] = _Storage(data, dtype, numel)
        return storages[key]

    try:
        value = restricted_loads(
            _read(f, records.pickle), what, resolve=_resolve, persistent=persistent
        )
    except UnsafePickleError as e:
        raise UnsafeCheckpointError(f"{e}; the checkpoint is damaged or crafted") from None
    return value
