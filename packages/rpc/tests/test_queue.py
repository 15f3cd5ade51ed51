"""Tier 1: the per-parameter serial queue (see [Note: Per-optimizer serial queue] in _queue.py)."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.rpc._queue import SerialQueue, queue_for

_TIMEOUT = 30.0


class _Ledger:
    """Records each operation's (name, start, end) and a read-modify-write counter that loses
    increments whenever two operations overlap."""

    def __init__(self) -> None:
        self.counter = 0
        self.spans: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def op(self, name: str, delay: float = 0.001) -> Any:
        def work() -> str:
            start = time.monotonic()
            value = self.counter
            time.sleep(delay)
            self.counter = value + 1
            with self._lock:
                self.spans.append((name, start, time.monotonic()))
            return name

        return work


def _no_overlap(spans: list[tuple[str, float, float]]) -> None:
    ordered = sorted(spans, key=lambda s: s[1])
    for a, b in itertools.pairwise(ordered):
        assert a[2] <= b[1], f"{a} and {b} overlap"


@settings(max_examples=15, deadline=None)
@given(kinds=st.lists(st.sampled_from(["run", "submit"]), min_size=1, max_size=12))
def test_operations_never_overlap_and_none_is_lost(kinds: list[str]) -> None:
    """Any mix of blocking and Future operations from concurrent threads: one at a time, all run
    (the counter equals a sequential reference count)."""
    queue, ledger = SerialQueue(), _Ledger()
    results: dict[int, Any] = {}

    def caller(i: int, kind: str) -> None:
        work = ledger.op(f"{kind}{i}")
        results[i] = queue.run(work) if kind == "run" else queue.submit(work).wait()

    pool = [threading.Thread(target=caller, args=(i, k)) for i, k in enumerate(kinds)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(_TIMEOUT)
    assert not any(t.is_alive() for t in pool), "a caller is stuck"
    assert ledger.counter == len(kinds)
    assert results == {i: f"{k}{i}" for i, k in enumerate(kinds)}
    _no_overlap(ledger.spans)
    assert queue.run(lambda: 7) == 7  # idle again: runs inline


def test_arrival_order_combining_and_hand_over() -> None:
    """Queued operations run in arrival order. The holder runs every operation that was queued
    when its own finished, `run` callers' included (each woken with its result, on the holder's
    thread); operations queued after that are not the holder's: the next waiting `run` caller
    is handed the queue and runs its own operation and later arrivals, so no holder serves
    forever. See [Note: Per-optimizer serial queue]."""
    queue, ledger = SerialQueue(), _Ledger()
    gate, late_gate = threading.Event(), threading.Event()
    returned: dict[str, float] = {}
    ran_on: dict[str, str] = {}

    def traced(name: str, work: Any) -> Any:
        def run() -> Any:
            ran_on[name] = threading.current_thread().name
            return work()

        return run

    def caller(name: str, work: Any) -> None:
        queue.run(traced(name, work))
        returned[name] = time.monotonic()

    def start(name: str, work: Any, queued: int) -> threading.Thread:
        thread = threading.Thread(target=caller, args=(name, work), name=name)
        thread.start()
        _until(lambda: len(queue._queue) == queued)
        return thread

    def b_then_hold() -> str:  # b runs on the holder's thread; "f" arrives while it runs
        result = ledger.op("b", 0.01)()
        threads.append(start("f", ledger.op("f"), 4))  # behind c, d, e
        late_gate.set()
        return result

    threads = [start("holder", lambda: gate.wait(_TIMEOUT), 0)]
    _until(lambda: queue._busy)
    threads.append(start("b", b_then_hold, 1))
    futs = [queue.submit(ledger.op("c"))]
    threads.append(start("d", ledger.op("d"), 3))
    futs.append(queue.submit(ledger.op("e")))
    gate.set()
    assert late_gate.wait(_TIMEOUT)
    for t in list(threads):
        t.join(_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a caller is stuck"
    assert [f.wait() for f in futs] == ["c", "e"]
    assert [name for name, _, _ in ledger.spans] == ["b", "c", "d", "e", "f"]
    _no_overlap(ledger.spans)
    assert ran_on["b"] == ran_on["d"] == "holder", ran_on  # combined on the holder's thread
    assert ran_on["f"] == "f", ran_on  # arrived later: handed over, ran on its own thread
    ends = {name: end for name, _, end in ledger.spans}
    assert returned["holder"] < ends["f"], "the holder served an operation queued after its turn"
    assert not queue._busy and not queue._queue


def test_errors_reach_their_caller_and_the_queue_goes_on() -> None:
    queue = SerialQueue()

    def boom() -> None:
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        queue.run(boom)
    fut = queue.submit(boom)
    with pytest.raises(ValueError, match="bad step"):
        fut.wait()
    assert queue.run(lambda: 1) == 1
    assert queue.submit(lambda: 2).wait() == 2
    assert not queue._busy and not queue._queue


def test_queue_for_shares_a_queue_between_overlapping_parameter_sets() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    qa = queue_for([a])
    assert queue_for([a]) is qa
    assert queue_for([a, b]) is qa  # b joins a's queue
    qc = queue_for([c])
    assert qc is not qa
    with pytest.raises(ValueError, match="already split between several"):
        queue_for([b, c])


def _until(condition: Any) -> None:
    deadline = time.monotonic() + _TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_waiting_for_a_turn_shows_in_a_profiler_trace() -> None:
    """A `run` caller that finds the queue busy waits inside a `shardkit.rpc.owner.wait_turn`
    range (see [Note: RPC profiler ranges]); RPC server threads are not the profiler's, hence
    `profile_all_threads`."""
    queue = SerialQueue()
    gate = threading.Event()
    holder = threading.Thread(target=queue.run, args=(lambda: gate.wait(_TIMEOUT),))
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config
    ) as prof:
        holder.start()
        _until(lambda: queue._busy)
        waiter = threading.Thread(target=queue.run, args=(lambda: None,))
        waiter.start()
        _until(lambda: len(queue._queue) == 1)
        gate.set()
        holder.join(_TIMEOUT)
        waiter.join(_TIMEOUT)
    names = {event.name for event in prof.events()}
    assert "shardkit.rpc.owner.wait_turn" in names, sorted(names)
    assert not queue._busy and not queue._queue
