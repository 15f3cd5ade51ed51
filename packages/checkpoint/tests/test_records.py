"""Records: JSON-like values as ``uint8`` tensors (``to_record`` / ``from_record``), read with
bounded work (see [Note: Checkpoint records])."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from shardkit.checkpoint import UnsafeCheckpointError, from_record, to_record

_ATOMS = st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats() | st.text()
_VALUES = st.recursive(
    _ATOMS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(
            st.text(max_size=6).filter(lambda k: k != "__shardkit__"), inner, max_size=4
        )
    ),
    max_leaves=12,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@given(_VALUES)
def test_json_like_values_round_trip_exactly(value: Any) -> None:
    """Tuples stay tuples, floats keep their exact value (NaN and infinities included), equal
    values give equal bytes."""
    t = to_record(value)
    assert t.dtype == torch.uint8 and t.dim() == 1
    assert _same(value, from_record(t))
    assert torch.equal(t, to_record(from_record(t)))


def test_scalars_and_refusals() -> None:
    lr = torch.tensor(0.25, dtype=torch.float64)
    back = from_record(to_record({"lr": lr}))["lr"]
    assert isinstance(back, torch.Tensor) and back.dtype == torch.float64 and back.item() == 0.25
    with pytest.raises(TypeError, match=r"value.x is a object"):
        to_record({"x": object()})
    with pytest.raises(TypeError, match="non-str keys"):
        to_record({1: 2})
    for text, match in (
        (b'{"__shardkit__": "scalar", "dtype": "Size", "value": 1}', "malformed tagged value"),
        (b'{"__shardkit__": "tuple", "items": 3}', "malformed tagged value"),
        (b"[1, 2", "not valid JSON"),
        (b"\xff", "not UTF-8"),
    ):
        with pytest.raises(UnsafeCheckpointError, match=match):
            from_record(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    with pytest.raises(UnsafeCheckpointError, match="not a 1-D uint8 tensor"):
        from_record(torch.zeros(2, dtype=torch.float32))
