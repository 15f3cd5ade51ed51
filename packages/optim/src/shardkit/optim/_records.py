"""shardkit-optim's own checkpoint records, validated against a schema on load.

[Note: Optimizer checkpoint records]
Format ``shardkit.optim.sharded/2`` stores nothing pickled of its own. Its records are
shardkit.checkpoint records (UTF-8 JSON in 1-D ``uint8`` tensors, tuples and 0-dim tensors
tagged: see [Note: Checkpoint records]):

- ``shardkit/header``: ``format``, ``token`` (the save's id, also in the commit record),
  ``world_size``, ``num_params``, ``param_shapes`` and ``checksums`` (the CRC-32 of every other
  item's tensor bytes, so a checkpoint whose commit record is lost can still be verified item by
  item);
- ``shardkit/param_groups``: the optimizer's param groups (hyperparams and global indices);
- ``value/<global index>/<state key>``: a non-tensor state value (e.g. SGD's
  ``momentum_buffer=None``).

The commit record holds the header's fields too (and, from shardkit-optim 0.4, the layout
fields of shardkit.checkpoint: the CRC-32 of every stored chunk). ``decode_*`` and
:func:`validate_header` check every field's type and range and raise ``UnsafeCheckpointError``
naming it, describing the value with bounds (see [Note: Bounded work on untrusted input]).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from shardkit.checkpoint import UnsafeCheckpointError, describe, from_record, to_record

__all__: list[str] = []

FORMAT = "shardkit.optim.sharded/3"
FORMAT_2 = "shardkit.optim.sharded/2"
"""Format 2: format 3 without compact items ([Note: Compact checkpoint items]); still loads."""
LEGACY_FORMAT = "shardkit.optim.sharded/1"
HEADER_KEY = "shardkit/header"
GROUPS_KEY = "shardkit/param_groups"
VALUE_PREFIX = "value/"
_TOKEN = re.compile(r"^[0-9a-f]{32}$")
_MAX_INT = 1 << 62


def encode_value(value: Any, where: str) -> torch.Tensor:
    """A non-tensor state value as a record tensor; raises TypeError if it is not JSON-like."""
    return to_record(value, where)


def decode_value(t: Any, where: str) -> Any:
    return from_record(t, where)


def encode_groups(groups: list[dict[str, Any]]) -> torch.Tensor:
    return to_record(groups, "param_groups")


def decode_groups(t: Any, num_params: int) -> list[dict[str, Any]]:
    """Param groups, checked: a list of dicts of str keys whose ``params`` together are the
    indices ``0..num_params-1`` in order."""
    raw = from_record(t, GROUPS_KEY)
    if not isinstance(raw, list):
        raise UnsafeCheckpointError(f"{GROUPS_KEY} is a {type(raw).__name__}, expected a list")
    groups: list[dict[str, Any]] = []
    flat: list[Any] = []
    for i, g in enumerate(raw):
        if type(g) is not dict or not isinstance(g.get("params"), list):
            raise UnsafeCheckpointError(f"{GROUPS_KEY}[{i}] is not a dict with a 'params' list")
        flat.extend(g["params"])
        groups.append(g)
    if not all(type(i) is int for i in flat) or flat != list(range(num_params)):
        raise UnsafeCheckpointError(
            f"{GROUPS_KEY} params are {describe(flat)}, expected the indices "
            f"0..{num_params - 1} in order; the checkpoint is damaged or crafted"
        )
    return groups


def from_tensor(t: Any, what: str) -> Any:
    """The value of a record tensor (the header: plain JSON, nothing tagged)."""
    return from_record(t, what)


def _check(cond: bool, field: str, value: Any, expected: str, what: str) -> None:
    if not cond:
        raise UnsafeCheckpointError(
            f"{what}: field {field!r} is {describe(value)}, expected {expected}; the checkpoint "
            f"is damaged or crafted"
        )


def _is_int(v: Any, lo: int, hi: int = _MAX_INT) -> bool:
    return type(v) is int and lo <= v <= hi


def validate_header(h: Any, what: str, legacy_ok: bool = False) -> dict[str, Any]:
    """Checks a header (the commit record's JSON, or the ``shardkit/header`` record).

    Raises:
        UnsafeCheckpointError: naming the first field that is missing or of the wrong type or
            range.
    """
    _check(type(h) is dict, "(record)", h, "a JSON object", what)
    formats = (FORMAT, FORMAT_2, LEGACY_FORMAT) if legacy_ok else (FORMAT, FORMAT_2)
    fmt = h.get("format")
    _check(fmt in formats, "format", fmt, " or ".join(formats), what)
    n = h.get("num_params")
    _check(_is_int(n, 0), "num_params", n, "an int >= 0", what)
    shapes = h.get("param_shapes")
    _check(
        type(shapes) is list
        and len(shapes) == n
        and all(type(s) is list and len(s) <= 64 and all(_is_int(d, 0) for d in s) for s in shapes),
        "param_shapes",
        shapes,
        f"a list of {n} shapes (lists of ints >= 0)",
        what,
    )
    ws = h.get("world_size")
    _check(_is_int(ws, 1, 1 << 24), "world_size", ws, "an int >= 1", what)
    token = h.get("token")
    _check(type(token) is str and bool(_TOKEN.match(token)), "token", token, "32 hex digits", what)
    sums = h.get("checksums", {})
    _check(
        type(sums) is dict
        and all(type(k) is str and _is_int(v, 0, 0xFFFFFFFF) for k, v in sums.items()),
        "checksums",
        sums,
        "an object of item name -> CRC-32 (int in [0, 2**32))",
        what,
    )
    return dict(h)
