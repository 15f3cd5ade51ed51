"""The ZeRO-2 bucket group's state machine ([Note: Bucket group state] in
``shardkit.optim._lifecycle``), single process: legal cycles reach the documented states, every
illegal call raises a ``RuntimeError`` naming the call and the state and changes nothing, and
random call sequences never leave the machine in a state its invariants rule out.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.optim import build_flat_buckets
from shardkit.optim._lifecycle import BucketPhase, GroupLife, GroupState, PassLife


def _life(n_buckets: int = 2) -> GroupLife:
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(n_buckets)]
    buckets, _ = build_flat_buckets(
        [{"params": params}], [True], 2, 1, 1
    )  # a tiny cap: one bucket per param
    assert len(buckets) == n_buckets
    return GroupLife("test group", buckets)


def _pool(life: GroupLife, k: int) -> torch.Tensor:
    return torch.zeros(life.buckets[k].bucket.numel)


def _snapshot(life: GroupLife) -> tuple[Any, ...]:
    return (
        life.state,
        dict(life.gathers),
        [
            (b.phase, frozenset(b.pending), frozenset(b.used), b.staging is None, b.work,
             b.clipped, b.bucket.grad_fresh)
            for b in life.buckets
        ],
    )  # fmt: skip


def _reduce_all(life: GroupLife) -> None:
    life.begin_pass()
    for k, b in enumerate(life.buckets):
        life.take_staging(k, _pool(life, k))
        for i in range(len(b.bucket.params)):
            life.stage(k, i, real=True)
        life.launch(k)
        life.issued(k, object())
    for k in range(len(life.buckets)):
        life.finish(k)


def test_a_cycle_walks_the_documented_states() -> None:
    life = _life()
    life.record = record = []
    _reduce_all(life)
    assert life.state is GroupState.REDUCED and life.holds_reduced()
    assert all(b.used == {0} for b in life.buckets)
    life.stepped()
    assert life.state is GroupState.STEPPED and not life.holds_reduced()
    assert all(not b.used and not b.clipped for b in life.buckets)
    for b in life.buckets:
        life.gather_issued(b.bucket.index, object())
    life.step_done()
    assert life.state is GroupState.GATHERING
    for b in life.buckets:
        life.gather_done(b.bucket.index)
    assert life.state is GroupState.IDLE and not life.gathers
    changes = [(a, b) for _, a, b in record if a is not b]
    S = GroupState
    assert changes == [
        (S.IDLE, S.REDUCING),
        (S.REDUCING, S.REDUCED),
        (S.REDUCED, S.STEPPED),
        (S.STEPPED, S.GATHERING),
        (S.GATHERING, S.IDLE),
    ]


def test_a_second_backward_accumulates_and_zero_grad_discards() -> None:
    life = _life()
    _reduce_all(life)
    life.mark_clipped()
    assert all(b.clipped for b in life.buckets)
    _reduce_all(life)  # REDUCED -> REDUCING -> REDUCED, into unconsumed shards
    assert life.state is GroupState.REDUCED
    assert all(b.bucket.grad_fresh is False for b in life.buckets)
    assert not any(b.clipped for b in life.buckets)  # a launch clears the clip
    life.discard()
    assert life.state is GroupState.IDLE and not life.holds_reduced()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda life: life.finish(0), r"finish\(\) in state IDLE: bucket \d+ is IDLE"),
        (lambda life: life.launch(0), r"launch\(\) in state IDLE: bucket \d+ is IDLE"),
        (lambda life: life.stage(0, 0, real=True), r"stage\(\) in state IDLE"),
        (lambda life: life.issued(0, None), r"issued\(\) in state IDLE"),
        (lambda life: life.step_done(), r"step_done\(\) in state IDLE: no step is running"),
        (lambda life: life.gather_done(0), r"gather_done\(\) in state IDLE: bucket 0 has no"),
        (lambda life: life.gather_issued(0, None), r"gather_issued\(\) in state IDLE"),
    ],
)
def test_illegal_calls_from_idle_raise_and_change_nothing(call: Any, message: str) -> None:
    life = _life()
    before = _snapshot(life)
    with pytest.raises(RuntimeError, match=message):
        call(life)
    assert _snapshot(life) == before


def test_illegal_calls_mid_cycle() -> None:
    life = _life()
    life.begin_pass()
    life.take_staging(0, _pool(life, 0))
    with pytest.raises(RuntimeError, match=r"take_staging\(\) .* bucket \d+ is STAGING"):
        life.take_staging(0, _pool(life, 0))
    with pytest.raises(RuntimeError, match=r"launch\(\) .* 1 params still to stage"):
        life.launch(0)
    life.stage(0, 0, real=False)
    with pytest.raises(RuntimeError, match=r"stage\(\) .* param 0 of bucket \d+ was staged"):
        life.stage(0, 0, real=True)
    assert life.buckets[0].used == set()  # zeros staged: not used
    life.launch(0)
    life.issued(0, object())
    assert life.state is GroupState.REDUCING and life.in_flight()
    for call, name in (
        (life.stepped, "stepped"),
        (life.discard, "discard"),
        (life.begin_pass, "begin_pass"),
        (life.mark_clipped, "mark_clipped"),
    ):
        with pytest.raises(RuntimeError, match=rf"{name}\(\) in state REDUCING: .* in flight"):
            call()
    life.finish(0)
    life.stepped()  # a backward that raised: REDUCING with nothing in flight may step
    with pytest.raises(RuntimeError, match=r"begin_pass\(\) in state STEPPED"):
        life.begin_pass()
    life.step_done()
    assert life.state is GroupState.IDLE


def test_the_pass_state() -> None:
    passes = PassLife()
    passes.start()
    passes.launched("g", 0)
    passes.launched("g", 1)
    assert passes.next_launch == 2 and passes.in_backward
    with pytest.raises(RuntimeError, match=r"start\(\) in a backward: 2 reduce-scatters"):
        passes.start()
    passes.end()
    passes.forget_aborted()
    with pytest.raises(RuntimeError, match=r"reset\(\) between backwards"):
        passes.reset()
    assert passes.finished(1) == ("g", 1) and passes.finished(0) == ("g", 0)
    with pytest.raises(RuntimeError, match=r"finished\(\) between backwards: no reduce"):
        passes.finished(0)
    passes.reset()
    assert passes.next_launch == 0 and not passes.in_backward


_CALLS = st.lists(
    st.sampled_from(
        ["begin", "stage_all", "launch", "finish", "step", "issue", "done", "wait", "discard"]
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(calls=_CALLS, k=st.integers(0, 1))
def test_random_calls_keep_the_invariants(calls: list[str], k: int) -> None:
    life = _life()
    for name in calls:
        try:
            if name == "begin":
                life.begin_pass()
            elif name == "stage_all":
                if life.buckets[k].phase is BucketPhase.IDLE:
                    life.take_staging(k, _pool(life, k))
                for i in sorted(life.buckets[k].pending):
                    life.stage(k, i, real=True)
            elif name == "launch":
                life.launch(k)
                life.issued(k, object())
            elif name == "finish":
                life.finish(k)
            elif name == "step":
                life.stepped()
            elif name == "issue":
                life.gather_issued(life.buckets[k].bucket.index, object())
            elif name == "done":
                life.step_done()
            elif name == "wait":
                life.gather_done(life.buckets[k].bucket.index)
            else:
                life.discard()
        except RuntimeError as e:
            assert "illegal transition" in str(e) and "test group" in str(e)
        for b in life.buckets:
            assert (b.phase is BucketPhase.IDLE) == (b.staging is None)
            assert (b.work is not None) <= (b.phase is BucketPhase.IN_FLIGHT)
            assert (b.phase is BucketPhase.IN_FLIGHT) <= (not b.pending)
        if life.in_flight():
            assert life.state is GroupState.REDUCING
        if life.state is GroupState.GATHERING:
            assert life.gathers
        if life.state is GroupState.REDUCED:
            assert life.holds_reduced() and not life.in_flight()
