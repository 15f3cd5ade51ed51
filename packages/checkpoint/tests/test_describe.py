"""``describe``: bounded descriptions of untrusted values, never repr / == / hash of them
(see [Note: Bounded work on untrusted input])."""

from __future__ import annotations

from typing import Any

import torch
from _ckpt_testkit import billion_laughs
from hypothesis import given
from hypothesis import strategies as st
from shardkit.checkpoint import describe

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner) | st.tuples(inner, inner) | st.dictionaries(st.text(), inner)
    | st.frozensets(st.integers()),
    max_leaves=50,
)  # fmt: skip


@given(_VALUES, st.integers(1, 32))
def test_descriptions_are_bounded(value: Any, budget: int) -> None:
    """Whatever the value, at most ``budget`` nodes of about 100 characters each."""
    assert len(describe(value, budget)) < 120 * (budget + 2)


class _Hostile:
    def __repr__(self) -> str:
        raise AssertionError("repr was called")

    def __eq__(self, other: object) -> bool:
        raise AssertionError("== was called")

    def __hash__(self) -> int:
        raise AssertionError("hash was called")


def test_unknown_objects_are_named_not_called() -> None:
    assert describe(_Hostile()) == "a _Hostile"
    assert (
        describe([_Hostile(), (_Hostile(),)]) == "list of 2: (a _Hostile, tuple of 1: (a _Hostile))"
    )


def test_shared_references_print_once() -> None:
    text = describe(billion_laughs(60))
    assert "<shared>" in text and len(text) < 300
    assert describe(int("9" * 100)) == "an int of 333 bits"
    assert describe("x" * 1000).endswith("... (1000 chars)")
    assert describe(torch.Size([3, 4])) == "torch.Size of 2 dims: (3, 4)"
    assert describe(torch.float16) == "torch.float16"
