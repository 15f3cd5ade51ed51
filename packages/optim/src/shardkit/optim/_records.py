"""shardkit's own checkpoint records as JSON, validated against a schema on load.

[Note: Checkpoint records]
Format ``shardkit.optim.sharded/2`` stores nothing pickled of its own. Its records are UTF-8
JSON held in 1-D ``uint8`` tensors (so DCP reads them with ``torch.load(weights_only=True)``
like any tensor, and they are checksummed like any tensor):

- ``shardkit/header``: ``format``, ``token`` (the save's id, also in the commit record),
  ``world_size``, ``num_params``, ``param_shapes`` and ``checksums`` (the CRC-32 of every other
  item, so a checkpoint whose commit record is lost can still be verified item by item);
- ``shardkit/param_groups``: the optimizer's param groups (hyperparams and global indices);
- ``value/<global index>/<state key>``: a non-tensor state value (e.g. SGD's
  ``momentum_buffer=None``).

Values are JSON with two tagged forms for what JSON lacks, ``{"__shardkit__": "tuple",
"items": [...]}`` (Adam's ``betas``) and ``{"__shardkit__": "scalar", "dtype": ..., "value":
...}`` (a 0-dim tensor hyperparameter such as a tensor ``lr``); floats keep their exact value
(``repr`` round-trips; NaN and infinities included). ``decode_*`` check every field's type and
range and raise ``UnsafeCheckpointError`` naming it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
from shardkit.optim._safe_reader import UnsafeCheckpointError

__all__: list[str] = []

FORMAT = "shardkit.optim.sharded/2"
LEGACY_FORMAT = "shardkit.optim.sharded/1"
HEADER_KEY = "shardkit/header"
GROUPS_KEY = "shardkit/param_groups"
VALUE_PREFIX = "value/"
_TAG = "__shardkit__"
_TOKEN = re.compile(r"^[0-9a-f]{32}$")
_MAX_DEPTH = 16
_MAX_INT = 1 << 62


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
        return [_encode(v, where, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_encode(v, where, depth + 1) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or _TAG in value:
            raise TypeError(f"{where}: a dict with non-str keys (or the key {_TAG!r})")
        return {k: _encode(v, where, depth + 1) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return {_TAG: "scalar", "dtype": str(value.dtype)[6:], "value": value.item()}
    raise TypeError(
        f"{where} is a {type(value).__name__} ({value!r:.80}); a sharded checkpoint stores "
        f"tensors and JSON-like values (None, bool, int, float, str, list, tuple, dict with str "
        f"keys, 0-dim tensors). Convert it, or save this optimizer with state_dict() instead."
    )


def _decode(value: Any, where: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise UnsafeCheckpointError(f"{where} is nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        if abs(value) > _MAX_INT:
            raise UnsafeCheckpointError(f"{where} holds the out-of-range int {value:.3e}")
        return value
    if isinstance(value, list):
        return [_decode(v, where, depth + 1) for v in value]
    if not isinstance(value, dict):
        raise UnsafeCheckpointError(f"{where} holds a {type(value).__name__}")
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    if tag == "tuple" and set(value) == {_TAG, "items"} and isinstance(value["items"], list):
        return tuple(_decode(v, where, depth + 1) for v in value["items"])
    if tag == "scalar" and set(value) == {_TAG, "dtype", "value"}:
        dtype = getattr(torch, str(value["dtype"]), None)
        v = value["value"]
        if isinstance(dtype, torch.dtype) and isinstance(v, (bool, int, float)):
            return torch.tensor(v, dtype=dtype)
    raise UnsafeCheckpointError(f"{where} holds a malformed tagged value {value!r:.100}")


def to_tensor(obj: Any) -> torch.Tensor:
    """JSON text of ``obj`` as a 1-D uint8 tensor (sorted keys: equal objects, equal bytes)."""
    data = json.dumps(obj, sort_keys=True, allow_nan=True).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def from_tensor(t: Any, what: str) -> Any:
    """The JSON object a record tensor holds."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise UnsafeCheckpointError(f"checkpoint record {what!r} is not a 1-D uint8 tensor")
    try:
        return json.loads(bytes(t.numpy().tobytes()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UnsafeCheckpointError(
            f"checkpoint record {what!r} is not valid JSON ({type(e).__name__}: {str(e)[:100]}); "
            f"the checkpoint is damaged or crafted"
        ) from None


def encode_value(value: Any, where: str) -> torch.Tensor:
    """A non-tensor state value as a record tensor; raises TypeError if it is not JSON-like."""
    return to_tensor(_encode(value, where))


def decode_value(t: Any, where: str) -> Any:
    return _decode(from_tensor(t, where), where)


def encode_groups(groups: list[dict[str, Any]]) -> torch.Tensor:
    return to_tensor([_encode(g, f"param_groups[{i}]") for i, g in enumerate(groups)])


def decode_groups(t: Any, num_params: int) -> list[dict[str, Any]]:
    """Param groups, checked: a list of dicts of str keys whose ``params`` together are the
    indices ``0..num_params-1`` in order."""
    raw = from_tensor(t, GROUPS_KEY)
    if not isinstance(raw, list):
        raise UnsafeCheckpointError(f"{GROUPS_KEY} is a {type(raw).__name__}, expected a list")
    groups: list[dict[str, Any]] = []
    flat: list[Any] = []
    for i, g in enumerate(raw):
        where = f"{GROUPS_KEY}[{i}]"
        if not isinstance(g, dict) or _TAG in g or not isinstance(g.get("params"), list):
            raise UnsafeCheckpointError(f"{where} is not a dict with a 'params' list")
        decoded = _decode(g, where)
        flat.extend(decoded["params"])
        groups.append(decoded)
    if flat != list(range(num_params)) or not all(type(i) is int for i in flat):
        raise UnsafeCheckpointError(
            f"{GROUPS_KEY} params are {flat[:10]!r:.200}, expected the indices 0..{num_params - 1} "
            f"in order; the checkpoint is damaged or crafted"
        )
    return groups


def _check(cond: bool, field: str, value: Any, expected: str, what: str) -> None:
    if not cond:
        raise UnsafeCheckpointError(
            f"{what}: field {field!r} is {type(value).__name__} {value!r:.100}, expected "
            f"{expected}; the checkpoint is damaged or crafted"
        )


def _is_int(v: Any, lo: int, hi: int = _MAX_INT) -> bool:
    return type(v) is int and lo <= v <= hi


def validate_header(h: Any, what: str, legacy_ok: bool = False) -> dict[str, Any]:
    """Checks a header (the commit record's JSON, or the ``shardkit/header`` record).

    Raises:
        UnsafeCheckpointError: naming the first field that is missing or of the wrong type or
            range.
    """
    _check(isinstance(h, dict), "(record)", h, "a JSON object", what)
    formats = (FORMAT, LEGACY_FORMAT) if legacy_ok else (FORMAT,)
    fmt = h.get("format")
    _check(fmt in formats, "format", fmt, " or ".join(formats), what)
    n = h.get("num_params")
    _check(_is_int(n, 0), "num_params", n, "an int >= 0", what)
    shapes = h.get("param_shapes")
    _check(
        isinstance(shapes, list)
        and len(shapes) == n
        and all(
            isinstance(s, list) and len(s) <= 64 and all(_is_int(d, 0) for d in s) for s in shapes
        ),
        "param_shapes",
        shapes,
        f"a list of {n} shapes (lists of ints >= 0)",
        what,
    )
    ws = h.get("world_size")
    _check(_is_int(ws, 1, 1 << 24), "world_size", ws, "an int >= 1", what)
    token = h.get("token")
    _check(
        isinstance(token, str) and bool(_TOKEN.match(token)), "token", token, "32 hex digits", what
    )
    sums = h.get("checksums", {})
    _check(
        isinstance(sums, dict)
        and all(isinstance(k, str) and _is_int(v, 0, 0xFFFFFFFF) for k, v in sums.items()),
        "checksums",
        sums,
        "an object of item name -> CRC-32 (int in [0, 2**32))",
        what,
    )
    return dict(h)
