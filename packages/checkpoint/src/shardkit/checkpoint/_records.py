"""JSON records: data a checkpoint keeps beside its tensors, never a pickle.

[Note: Checkpoint records]
A record is UTF-8 JSON. The commit record (``SHARDKIT_COMMIT``, see [Note: Atomic commit]) is a
file; a record inside the DCP state dict (:func:`to_record`) is a 1-D ``uint8`` tensor, so DCP
reads it with ``torch.load(weights_only=True)`` like any tensor and checksums it like any tensor.
Values are JSON with two tagged forms for what JSON lacks, ``{"__shardkit__": "tuple", "items":
[...]}`` (Adam's ``betas``) and ``{"__shardkit__": "scalar", "dtype": ..., "value": ...}`` (a 0-dim
tensor such as a tensor ``lr``); floats keep their exact value (``repr`` round-trips; NaN and
infinities included). Keys are sorted, so equal values give equal bytes.

Reading one is bounded work (see [Note: Bounded work on untrusted input]): the text is parsed
only if its brackets nest at most 64 deep (a linear scan first, so a document of a million
``[`` is refused at once instead of recursing), decoded values at most 16 deep, integers at most
2**62 in magnitude (JSON numbers of thousands of digits are refused by the parser), and every
error names the record and describes the value with :func:`describe`.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import re
from typing import Any

import torch
from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._errors import UnsafeCheckpointError

__all__ = ["dumps_json", "from_record", "loads_json", "tensor_bytes", "to_record"]

_TAG = "__shardkit__"
_MAX_DEPTH = 16
_MAX_JSON_DEPTH = 64
_MAX_INT = 1 << 62
# a JSON string: runs of plain characters between escapes (no per-character backtracking state)
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DELTA = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor (any dtype, any device; copied to a contiguous CPU tensor when it
    is not one), without NumPy and without a copy of a contiguous CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.cpu().contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    buf.tensor = t  # type: ignore[attr-defined]  # the view keeps buf, buf keeps the tensor
    return memoryview(buf).cast("B")


def dumps_json(obj: Any) -> str:
    """JSON text of ``obj`` with sorted keys (equal objects, equal bytes); NaN and infinities as
    Python writes them."""
    return json.dumps(obj, sort_keys=True, allow_nan=True)


def _depth(data: bytes) -> int:
    """How deep the brackets of a JSON text nest, strings ignored: linear, in C loops (a regex,
    ``bytes.translate``, ``itertools.accumulate`` over a table lookup)."""
    brackets = _STRINGS.sub(b'""', data).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_DELTA.__getitem__, brackets)), default=0)


def loads_json(data: bytes, what: str) -> Any:
    """Parses a JSON record with bounded work (see [Note: Checkpoint records]).

    Raises:
        UnsafeCheckpointError: not UTF-8 JSON, nested deeper than 64, or a number beyond what
            Python parses (thousands of digits).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UnsafeCheckpointError(
            f"{what} is not UTF-8 text; the checkpoint is damaged or crafted"
        ) from None
    if _depth(data) > _MAX_JSON_DEPTH:
        raise UnsafeCheckpointError(
            f"{what} nests deeper than {_MAX_JSON_DEPTH} levels; the checkpoint is damaged or "
            f"crafted"
        )
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UnsafeCheckpointError(
            f"{what} is not valid JSON ({type(e).__name__}: {str(e)[:100]}); the checkpoint is "
            f"damaged or crafted"
        ) from None


def _encode(value: Any, where: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise TypeError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        items = [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        return {_TAG: "tuple", "items": items}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or _TAG in value:
            raise TypeError(f"{where}: a dict with non-str keys (or the key {_TAG!r})")
        return {k: _encode(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return {_TAG: "scalar", "dtype": str(value.dtype)[6:], "value": value.item()}
    raise TypeError(
        f"{where} is a {type(value).__name__} ({describe(value)}); a record holds JSON-like "
        f"values (None, bool, int, float, str, list, tuple, dict with str keys, 0-dim tensors). "
        f"Convert it, or store it as a tensor."
    )


def _decode(value: Any, where: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise UnsafeCheckpointError(f"{where} is nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        if abs(value) > _MAX_INT:
            raise UnsafeCheckpointError(f"{where} holds the out-of-range int {describe(value)}")
        return value
    if isinstance(value, list):
        return [_decode(v, where, depth + 1) for v in value]
    if not isinstance(value, dict):
        raise UnsafeCheckpointError(f"{where} holds a {type(value).__name__}")
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode(v, f"{where}.{describe(k, 1)}", depth + 1) for k, v in value.items()}
    if tag == "tuple" and set(value) == {_TAG, "items"} and isinstance(value["items"], list):
        return tuple(_decode(v, where, depth + 1) for v in value["items"])
    if tag == "scalar" and set(value) == {_TAG, "dtype", "value"}:
        name = value["dtype"]
        dtype = vars(torch).get(name) if type(name) is str else None
        v = value["value"]
        if isinstance(dtype, torch.dtype) and type(v) in (bool, int, float):
            if type(v) is int and abs(v) > _MAX_INT:
                raise UnsafeCheckpointError(f"{where} holds the out-of-range int {describe(v)}")
            return torch.tensor(v, dtype=dtype)
    raise UnsafeCheckpointError(f"{where} holds a malformed tagged value {describe(value)}")


def to_record(value: Any, where: str = "value") -> torch.Tensor:
    """A JSON-like value as a record tensor (1-D ``uint8``, UTF-8 JSON): a way to keep small
    non-tensor state (a step count, a config, a data loader position) in a DCP state dict as
    data instead of a pickle. See [Note: Checkpoint records].

    Args:
        value: None, bool, int, float, str, list, tuple, dict with str keys, or a 0-dim tensor,
            nested at most 16 deep.
        where: names the value in errors.

    Raises:
        TypeError: a value of another type, naming where it is.
    """
    data = dumps_json(_encode(value, where)).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def from_record(t: Any, what: str = "record") -> Any:
    """The value a record tensor holds (see :func:`to_record`); safe on untrusted input.

    Raises:
        UnsafeCheckpointError: ``t`` is not a 1-D ``uint8`` tensor of JSON, or a value is
            malformed, nested too deep or out of range.
    """
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise UnsafeCheckpointError(f"checkpoint record {what!r} is not a 1-D uint8 tensor")
    raw = loads_json(bytes(tensor_bytes(t)), f"checkpoint record {what!r}")
    return _decode(raw, what)
