"""The call agreement's transport: the c10d store (issue 36, [Note: Agreement over the store]).

Every outcome of an exchange is the same on every rank: a rank that gives up waiting claims the
missing ranks' slots, a rank that comes later finds its slot claimed and raises at once, and
ranks that all turn up go on together, even when one of them timed out meanwhile. The store
holds at most two keys per rank and group whatever the number of steps. The ``@world`` pool
runs on a FileStore (polled); one test runs the same protocol on a TCPStore (torchrun's store,
blocking waits). The torchrun jobs of ``tests-integration/test_rank_failure_jobs.py`` check
that a rank that raised exits.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _optim_testkit import train
from shardkit.optim import ShardedOptimizer, agree_call
from shardkit.optim._agreement import CONSOLIDATE_CALL, STEP_CALL
from shardkit.optim._agreement import GaveUp, _Channel, channel
from shardkit.optim._torch_compat import default_store
from shardkit.partition import all_gather_objects
from shardkit.testing import world
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _opt(model: nn.Module, timeout: float, group: dist.ProcessGroup | None = None) -> Any:
    return ShardedOptimizer(
        model.parameters(), torch.optim.Adam, group=group, lr=0.01, collective_timeout=timeout
    )


def _channel_keys(group: dist.ProcessGroup) -> list[str]:
    prefix = f"shardkit.optim/agree/{group.group_name}/"
    return sorted(k for k in default_store().list_keys() if k.startswith(prefix))


@world(2, timeout=90)
def test_store_keys_do_not_grow_with_steps_or_failures() -> None:
    """Between exchanges a channel holds the last exchange's counter and outcome, whatever the
    number of steps, and an exchange given up leaves nothing once the ranks go on."""
    group = dist.new_group([0, 1])
    model = _model()
    opt = _opt(model, 1.0, group=group)
    train(model, opt, 3)
    dist.barrier()
    assert [k.rsplit("/", 2)[1:] for k in _channel_keys(group)] == [["2", "n"], ["2", "out"]]
    dist.barrier()  # every rank has read them before any rank steps on
    train(model, opt, 40, start=3)
    dist.barrier()
    assert [k.rsplit("/", 2)[1:] for k in _channel_keys(group)] == [["42", "n"], ["42", "out"]]
    dist.barrier()
    for _ in range(2):  # two exchanges given up in a row: rank 1 never comes, then comes late
        if dist.get_rank() == 0:
            with pytest.raises(RuntimeError, match="did not"):
                opt.consolidate_state_dict(recipient_rank=0)
        else:
            time.sleep(1.5)
            with pytest.raises(RuntimeError, match="different collective calls"):
                opt.step()
        dist.barrier()
    train(model, opt, 2, start=43)
    dist.barrier()
    keys = [k.rsplit("/", 2)[1:] for k in _channel_keys(group)]
    assert keys == [["46", "n"], ["46", "out"]], keys


@world(2, timeout=90)
def test_a_rank_that_comes_late_raises_at_once_and_the_ranks_go_on_together() -> None:
    model = _model()
    opt = _opt(model, 1.0)
    train(model, opt, 1)
    model(torch.ones(2, 4)).sum().backward()
    start = time.monotonic()
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match=r"waited 0:00:01 .* global rank\(s\) \[1\] did not"):
            opt.step()
        assert time.monotonic() - start < 15
    else:
        time.sleep(2.5)  # rank 0 gave up by now
        start = time.monotonic()
        with pytest.raises(
            RuntimeError,
            match=r"global rank 0 called ShardedOptimizer.step\(\) and gave up after waiting "
            r"0:00:01 for this rank \(global rank 1\), which reached it only now",
        ):
            opt.step()
        assert time.monotonic() - start < 1.0  # at once, not after another timeout
    dist.barrier()  # rank 1 is 2.5 s behind: catch up (or its next step comes late again)
    train(model, opt, 2, start=1)  # both ranks are in step again


@world(3, timeout=120)
def test_two_ranks_waiting_for_a_third_both_raise_naming_it() -> None:
    model = _model()
    opt = _opt(model, 1.5)
    train(model, opt, 1)
    if dist.get_rank() < 2:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"consolidate_state_dict.*global rank\(s\) \[2\]"):
            opt.consolidate_state_dict(recipient_rank=0)
        assert time.monotonic() - start < 15
    else:
        time.sleep(3.5)
        with pytest.raises(
            RuntimeError,
            match=r"different collective calls: global rank \d called .*"
            r"consolidate_state_dict\(\) and gave up .* which calls ShardedOptimizer.step\(\)",
        ):
            opt.step()
    dist.barrier()
    train(model, opt, 1, start=1)


@world(2, timeout=90)
def test_a_timeout_with_every_rank_present_goes_on() -> None:
    """Rank 0's wait times out, but rank 1 arrived (and published the outcome) before rank 0
    gave the exchange up: rank 0 reads the outcome and both ranks go on (nobody raises,
    nobody is left waiting)."""
    model = _model()
    opt = _opt(model, 5.0)
    train(model, opt, 1)
    if dist.get_rank() == 0:
        real = _Channel._wait
        calls: list[str] = []

        def first_wait_times_out(self: _Channel, key: str, timeout: timedelta) -> bool:
            calls.append(key)
            if len(calls) > 1:
                return real(self, key, timeout)
            time.sleep(1.5)  # rank 1 arrives meanwhile
            return False

        _Channel._wait = first_wait_times_out  # type: ignore[method-assign]
        try:
            train(model, opt, 1, start=1)
        finally:
            _Channel._wait = real  # type: ignore[method-assign]
        assert len(calls) == 2, calls  # the timed-out wait, then the outcome's
    else:
        time.sleep(0.5)  # rank 0 waits first
        train(model, opt, 1, start=1)
    train(model, opt, 1, start=2)


@world(3, timeout=120)
def test_a_sub_group_agrees_on_its_own_keys_and_stays_usable() -> None:
    sub = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return
    model = _model()
    opt = _opt(model, 1.0, group=sub)
    train(model, opt, 1)
    if dist.get_rank() == 1:
        with pytest.raises(RuntimeError, match=r"state_dict\(\).* global rank\(s\) \[2\] did not"):
            opt.state_dict(all_ranks=True)
    else:
        time.sleep(2.0)
        with pytest.raises(RuntimeError, match=r"different collective calls.*state_dict"):
            opt.step()
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)  # nothing of the agreement paired with the sub group
    assert t.item() == 2.0
    train(model, opt, 1, start=1)


@world(2, timeout=60)
def test_each_channel_of_a_group_has_its_own_keys() -> None:
    """Each channel draws its own token: a group re-created under a reused name (after
    destroy_process_group) never reads an older channel's keys."""
    group = dist.new_group([0, 1])
    first, second = _Channel(group), _Channel(group)
    assert first.store is not second.store
    for ch, value in ((first, 7), (second, 8), (first, 9)):
        done = ch.exchange((value, dist.get_rank()), timedelta(seconds=20))
        assert (done.maxes, done.by_first, done.gave_up) == ((value, 1), None, None)
    done = first.exchange((dist.get_rank(), 0), timedelta(seconds=20))
    assert done.by_first == {0: (0,), 1: (1,)}


@world(2, timeout=90)
def test_the_protocol_on_a_tcp_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's store: blocking waits on a client of the channel's own."""
    import shardkit.optim._agreement as exchange_module

    rank = dist.get_rank()
    server = (
        dist.TCPStore("127.0.0.1", 0, 2, rank == 0, wait_for_workers=False) if rank == 0 else None
    )
    port = all_gather_objects(server.port if server is not None else None, dist.group.WORLD)[0]
    store = server if server is not None else dist.TCPStore("127.0.0.1", port, 2, False)
    monkeypatch.setattr(exchange_module, "default_store", lambda: store)
    group = dist.new_group([0, 1])
    assert channel(group).poll is False
    timeout = timedelta(seconds=1)
    agree_call(STEP_CALL, group, timeout)
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"waited 0:00:01 .* global rank\(s\) \[1\] did not"):
            agree_call(CONSOLIDATE_CALL, group, timeout)
    else:
        time.sleep(2.0)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="different collective calls"):
            agree_call(STEP_CALL, group, timeout)
        assert time.monotonic() - start < 1.0
    assert agree_call(STEP_CALL, group, timeout, digest=5) == (1, 0, 0)
    dist.barrier()


@world(1)
def test_a_store_failure_names_the_call_and_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    def lost(self: _Channel, values: tuple[int, ...], timeout: timedelta) -> Any:
        raise dist.DistNetworkError("Connection reset by peer")

    monkeypatch.setattr(_Channel, "exchange", lost)
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    with pytest.raises(
        RuntimeError,
        match=r"called ShardedOptimizer\.step\(\), but its call agreement lost the c10d store "
        r"\(DistNetworkError: Connection reset by peer\)",
    ):
        agree_call(STEP_CALL, group, timedelta(seconds=1))


def test_records_round_trip() -> None:
    from shardkit.optim._agreement import _decode, _encode_gave_up, _encode_outcome

    maxes = (1, -(2**62), 0, 1)
    assert _decode(_encode_outcome(maxes, None).encode()) == (maxes, None)
    by_first = {5: (0, 2), 7: (1,)}
    assert _decode(_encode_outcome(maxes, by_first).encode()) == (maxes, by_first)
    g = GaveUp(rank=1, values=(5, -5, 6, -6, 0, 0), waited_s=2.5, missing=(0, 3))
    assert _decode(_encode_gave_up(g).encode()) == g
    with pytest.raises(RuntimeError, match="unexpected agreement record"):
        _decode(b"xyz")
