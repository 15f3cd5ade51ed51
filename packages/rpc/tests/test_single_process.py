"""Tier 1: single-process checks (keys, validation before any RPC, helpers)."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from shardkit.rpc import (
    DistributedOptimizer,
    ParamGroupsView,
    RemoteOptimizerError,
    _local_optimizer,
    _logging,
    _optimizer,
    _owner,
    _profiling,
    _script_step,
)
from shardkit.rpc._keys import param_key, remap_key, split_param_key
from shardkit.rpc._optimizer import _normalise_groups, _rpc_timeout, _same, _snapshot
from shardkit.rpc._torch_compat import profiling

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


# -- the TorchScript step entry point (see [Note: Step requests]) --------------------------------


def test_script_step_compiles_without_warnings() -> None:
    """On this torch the step entry point is a TorchScript function; compiling it shows the user
    no warning (torch 2.13 deprecates `torch.jit.script`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = _script_step._compile()
    assert isinstance(compiled, torch.jit.ScriptFunction)
    assert isinstance(_script_step.script_step, torch.jit.ScriptFunction)
    assert compiled.qualified_name.endswith("shardkit.rpc._script_step._remote_step_script")


def test_script_step_reports_failures_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Called locally (no RPC), a failing step comes back as the text the trainer raises (type,
    message, owner traceback), not as a TorchScript interpreter error."""

    def unknown(handle: int) -> None:
        raise ValueError(f"no optimizer {handle}")

    monkeypatch.setattr(_local_optimizer, "_lookup", unknown)
    text = _script_step.script_step(12, 1)
    assert isinstance(text, str), text
    assert text.startswith("ValueError: no optimizer 12\n\nOwner traceback:"), text
    assert "in step_and_wait" in text, text


def test_script_step_fallback_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(fn: object) -> object:
        raise RuntimeError("no TorchScript here")

    caplog.set_level(logging.INFO, logger="shardkit.rpc")
    monkeypatch.setattr(torch.jit, "script", broken)
    assert _script_step._compile() is None
    monkeypatch.setattr(torch.jit, "script", lambda fn: fn)  # what PYTORCH_JIT=0 does
    assert _script_step._compile() is None
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shardkit.rpc"]
    assert len(messages) == 2, messages
    assert messages[0][0] == logging.WARNING and "no TorchScript here" in messages[0][1]
    assert messages[1][0] == logging.INFO and "PYTORCH_JIT=0" in messages[1][1]
    assert all("Python RPC calls" in text for _, text in messages)


# -- logging and profiler ranges (see [Note: RPC profiler ranges]) ------------------------------------


@pytest.fixture
def fresh_log(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Any:
    """caplog at DEBUG on ``shardkit.rpc``, with nothing logged once yet in this process."""
    monkeypatch.setattr(_logging, "_logged", set())
    caplog.set_level(logging.DEBUG, logger="shardkit.rpc")
    return caplog


def _messages(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shardkit.rpc"]


def test_log_once_per_key(fresh_log: pytest.LogCaptureFixture) -> None:
    for _ in range(3):
        _logging.log_once("a", logging.INFO, "fallback %s", "a")
    _logging.log_once("b", logging.WARNING, "fallback %s", "b")
    assert _messages(fresh_log) == [(logging.INFO, "fallback a"), (logging.WARNING, "fallback b")]


def test_python_step_for_an_owner_without_torchscript_is_logged_once(
    fresh_log: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _optimizer._step_call("w1", True) is _script_step.script_step
    for _ in range(2):
        assert _optimizer._step_call("w1", False) is _owner._remote_step
    assert _optimizer._step_call("w2", False) is _owner._remote_step
    messages = _messages(fresh_log)
    assert [level for level, _ in messages] == [logging.INFO, logging.INFO], messages
    assert "w1 has no TorchScript step entry point" in messages[0][1]
    assert "w2 has no TorchScript step entry point" in messages[1][1]
    # Without TorchScript here, `_script_step` logged it already (at import): nothing more.
    monkeypatch.setattr(_optimizer, "script_step", None)
    assert _optimizer._step_call("w3", True) is _owner._remote_step
    assert len(_messages(fresh_log)) == 2


class _Incomparable:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("ambiguous")

    __hash__ = object.__hash__


def test_incomparable_option_is_treated_as_changed_and_logged_once(
    fresh_log: pytest.LogCaptureFixture,
) -> None:
    a, b = _Incomparable(), _Incomparable()
    assert not _same(a, b, "mode")
    assert not _same(b, a, "mode")
    messages = _messages(fresh_log)
    assert len(messages) == 1, messages
    assert (
        "option 'mode'" in messages[0][1] and "sent to the owners with every step" in messages[0][1]
    )


def test_profiling_flag_follows_the_profiler() -> None:
    """Pins torch.autograd.profiler._is_profiler_enabled (see _torch_compat.py): set by both
    profiler entry points while they run, process-wide."""
    assert profiling() is False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert profiling() is True
    assert profiling() is False
    with torch.autograd.profiler.profile():
        assert profiling() is True
    assert profiling() is False


def test_profiling_without_the_flag_records_always_and_logs_once(
    fresh_log: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch.autograd.profiler, "_is_profiler_enabled")
    assert profiling() is True and profiling() is True
    messages = _messages(fresh_log)
    assert len(messages) == 1 and "recorded on every step" in messages[0][1], messages


def test_phase_is_a_range_only_while_profiling() -> None:
    assert _profiling.phase("shardkit.rpc.test") is _profiling._NO_RANGE
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with _profiling.phase("shardkit.rpc.test"):
            torch.ones(2).add_(1)
    names = {event.name for event in prof.events()}
    assert "shardkit.rpc.test" in names, sorted(names)
