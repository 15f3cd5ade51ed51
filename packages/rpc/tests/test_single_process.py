"""Tier 1: single-process checks (keys, validation before any RPC, helpers)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from shardkit.rpc import DistributedOptimizer, ParamGroupsView, RemoteOptimizerError
from shardkit.rpc._keys import param_key, remap_key, split_param_key
from shardkit.rpc._optimizer import _normalise_groups, _rpc_timeout, _same, _snapshot

owner_names = st.text(min_size=1, max_size=12).filter(lambda s: s.strip() != "")


@given(owner=owner_names, position=st.integers(min_value=0, max_value=10**9))
def test_param_key_round_trip(owner: str, position: int) -> None:
    assert split_param_key(param_key(owner, position)) == (owner, position)


@given(owner=owner_names, position=st.integers(min_value=0, max_value=1000), new=owner_names)
def test_owner_map_renames_only_that_owner(owner: str, position: int, new: str) -> None:
    key = param_key(owner, position)
    assert remap_key(key, {owner: new}, None) == param_key(new, position)
    assert remap_key(key, {owner + "x": new}, None) == key


def test_key_map_wins_over_owner_map_and_accepts_functions() -> None:
    assert remap_key("a:0", {"a": "b"}, {"a:0": "c:3"}) == "c:3"
    assert remap_key("a:1", {"a": "b"}, {"a:0": "c:3"}) == "b:1"
    assert remap_key("a:1", None, lambda k: k.replace("a", "z")) == "z:1"
    with pytest.raises(TypeError, match="must return the new key"):
        remap_key("a:1", None, lambda k: 3)  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize("bad", ["worker1", "worker1:", ":3", "w:x", "w:-1"])
def test_malformed_keys_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="malformed parameter key"):
        split_param_key(bad)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "5"])
def test_bad_timeouts(bad: object) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive finite number"):
        _rpc_timeout(bad)  # type: ignore[arg-type]


def test_good_timeouts() -> None:
    assert _rpc_timeout(2) == 2.0
    assert _rpc_timeout(None) < 0  # the agent default sentinel


def test_non_rref_params_raise_before_any_rpc() -> None:
    # RPC is not initialised in this process: reaching an RPC would raise a different error.
    with pytest.raises(TypeError, match=r"(?s)params_rref\[0\] is a Parameter.*rpc.RRef"):
        DistributedOptimizer(torch.optim.SGD, [torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(TypeError, match="param group 0 'params'\\[0\\] is a int"):
        DistributedOptimizer(torch.optim.SGD, [{"params": [3]}], lr=0.1)
    with pytest.raises(TypeError, match="must be an iterable"):
        DistributedOptimizer(torch.optim.SGD, torch.ones(2), lr=0.1)
    with pytest.raises(ValueError, match="params_rref is empty"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)
    with pytest.raises(ValueError, match="has no 'params' key"):
        DistributedOptimizer(torch.optim.SGD, [{"lr": 1.0}])
    with pytest.raises(ValueError, match="empty 'params' list"):
        DistributedOptimizer(torch.optim.SGD, [{"params": []}])


def test_optimizer_class_is_checked() -> None:
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer subclass"):
        DistributedOptimizer(
            torch.optim.SGD(  # an instance, not a class
                [torch.nn.Parameter(torch.ones(1))], lr=0.1
            ),
            [],
        )  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer subclass"):
        DistributedOptimizer(dict, [])  # type: ignore[arg-type]


def test_normalise_rejects_mixed_groups() -> None:
    with pytest.raises(TypeError, match="mixes param-group dicts and bare RRefs"):
        _normalise_groups([3, {"params": []}])


@given(
    st.floats(allow_nan=False)
    | st.integers()
    | st.tuples(st.floats(allow_nan=False), st.floats(allow_nan=False))
)
def test_snapshot_compares_equal_to_itself(value: object) -> None:
    assert _same(_snapshot(value), value)


def test_same_detects_tensor_and_type_changes() -> None:
    lr = torch.tensor(0.1)
    snap = _snapshot(lr)
    assert _same(snap, lr)
    lr.fill_(0.2)  # an in-place scheduler edit must count as a change
    assert not _same(snap, lr)
    assert not _same(1, 1.0)
    assert not _same(torch.tensor(1.0), 1.0)
    assert not _same(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))


def test_view_step_refuses_direct_calls() -> None:
    view = ParamGroupsView([{"params": [], "lr": 0.1}], {"lr": 0.1})
    with pytest.raises(RuntimeError, match=r"DistributedOptimizer.step\(context_id\)"):
        view.step()
    sched = torch.optim.lr_scheduler.StepLR(view, step_size=1, gamma=0.5)
    assert view.param_groups[0]["initial_lr"] == 0.1
    assert sched.get_last_lr() == [0.1]


def test_remote_error_names_every_failure() -> None:
    err = RemoteOptimizerError(
        "step(context_id=7)",
        {"w2": RuntimeError("boom\ntrace"), "w1": TimeoutError("late")},
        ["w0"],
    )
    text = str(err)
    assert "failed on 2 of 3 owner" in text
    assert "[w1] TimeoutError: late" in text and "[w2] RuntimeError: boom" in text
    assert "completed on ['w0']" in text
    assert set(err.failures) == {"w1", "w2"} and err.succeeded == ["w0"]
