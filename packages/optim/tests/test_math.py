"""Single-process tier: the layout invariants and state-dict validation, no process group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.optim._consolidate import _by_dtype
from shardkit.optim._layout import _build_layout
from shardkit.optim._state import _local_load_dict, _validate_plain_state_dict


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(1, 50), min_size=0, max_size=6), min_size=1, max_size=3),
    world=st.integers(1, 5),
    frozen=st.integers(0, 2**16),
    algorithm=st.sampled_from(["greedy", "sorted_greedy", "balanced"]),
)
def test_layout_owns_every_param_exactly_once(
    sizes: list[list[int]], world: int, frozen: int, algorithm: str
) -> None:
    groups = []
    k = 0
    for g in sizes:
        ps = []
        for n in g:
            p = torch.nn.Parameter(torch.zeros(n), requires_grad=not (frozen >> k) & 1)
            ps.append(p)
            k += 1
        groups.append({"params": ps})
    layout = _build_layout(groups, world, algorithm)
    flat = [p for g in groups for p in g["params"]]
    assert list(layout.params) == flat
    owned = sorted(i for r in range(world) for i in layout.owned(r))
    assert owned == list(range(len(flat)))
    assert all(0 <= r < world for r in layout.owner)
    assert layout.trainable == tuple(p.requires_grad for p in flat)
    # deterministic: every rank computes the same layout
    assert _build_layout(groups, world, algorithm).owner == layout.owner


def test_validation_messages() -> None:
    ps = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(3))]
    groups = [{"params": ps, "lr": 0.1}]
    good = {"state": {0: {"m": torch.zeros(2, 3)}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    _validate_plain_state_dict(good, groups)
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        _validate_plain_state_dict(
            {"state": {0: {"m": torch.zeros(3, 3)}}, "param_groups": good["param_groups"]}, groups
        )
    with pytest.raises(ValueError, match="int indices"):
        _validate_plain_state_dict(
            {"state": {"0": {}}, "param_groups": good["param_groups"]}, groups
        )
    with pytest.raises(ValueError, match=r"0\.\.1"):
        _validate_plain_state_dict(
            {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 0]}]}, groups
        )


def test_local_load_dict_clones_and_maps_by_position() -> None:
    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    groups = [{"params": ps}]
    layout = _build_layout(groups, 1, "greedy")
    m = torch.arange(2.0)
    # saved ids need not be 0..n-1 in order: position in the group decides
    sd = {"state": {7: {"m": m}}, "param_groups": [{"lr": 1.0, "params": [5, 6, 7]}]}
    local = _local_load_dict(sd, layout, 0, 1, {})
    assert list(local["state"]) == [2]
    assert torch.equal(local["state"][2]["m"], m)
    assert local["state"][2]["m"].data_ptr() != m.data_ptr()
    assert local["param_groups"] == [{"lr": 1.0, "params": [0, 1, 2]}]


def test_by_dtype_groups_and_skips() -> None:
    metas = [
        (0, "a", (2,), torch.float32, False),
        (0, "step", (), torch.int64, False),
        (1, "a", (3,), torch.float32, True),
        (2, "a", (1,), torch.float32, False),
    ]
    out = _by_dtype(metas)
    assert [d for d, _ in out] == [torch.float32, torch.int64]
    assert [m[0] for m in out[0][1]] == [0, 2]
