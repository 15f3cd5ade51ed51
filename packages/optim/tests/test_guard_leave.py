"""The param-access guard's deferred leave ([Note: Leaving after a collection] and [Note: One
profile object per thread] in ``shardkit.optim._gather``), single process: the guard is pushed
by hand, and collections run the weakref callbacks that schedule its leave."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import shardkit.optim._gather as G
import torch


@contextmanager
def _guard_on_stack() -> Iterator[G._ParamGuard]:
    """A fresh guard of this thread's, on the mode stack; everything restored afterwards."""
    previous = getattr(G._local, "guard", None)
    depth = G.function_mode_count()
    guard = G._local.guard = G._ParamGuard()
    G.push_function_mode(guard)
    guard.on_stack = True
    try:
        yield guard
    finally:
        sys.setprofile(None)
        if guard.on_stack:
            G.remove_function_mode(guard)
        G._local.guard = previous
        assert G.function_mode_count() == depth


def _in_dispatch(body: Callable[[], None]) -> None:
    """Runs ``body`` inside a dispatch of ``torch.overrides`` (as a collection inside a torch
    call would): the deferred leave waits for it to return."""

    def call(t: torch.Tensor) -> None:
        if torch.overrides.has_torch_function((t,)):
            torch.overrides.handle_torch_function(call, (t,), t)
            return
        body()

    call(torch.zeros(1))


class _Node:
    me: object


def test_collections_rearm_one_profile_object_in_place() -> None:
    """Collections inside profile events re-arm the deferred leave many times (the garbage
    collector runs at nearly every allocation, each collection's weakref callback schedules
    the leave): the thread's profile function stays one object, alive however often it is
    re-armed or cleared, and the guard leaves once the dispatch has returned. Replacing it
    with a new object per collection freed the object CPython was about to call (a SIGSEGV a
    few tests later in CI)."""
    seen: set[int] = set()
    rearmed = [0]

    def collected(_ref: object) -> None:
        G.leave_when_safe()
        hook = sys.getprofile()
        if hook is not None:
            rearmed[0] += 1
            seen.add(id(hook))

    def body() -> None:
        keep: list[weakref.ref[_Node]] = []
        for i in range(3000):
            n = _Node()
            n.me = n  # a cycle: freed by the collector, which runs the callback
            keep.append(weakref.ref(n, collected))
            del n
            abs(i)  # a call event, whose frame and locals CPython allocates before the call
        assert guard.on_stack  # inside the dispatch: the leave waits for it to return

    thresholds = gc.get_threshold()
    with _guard_on_stack() as guard:
        gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation
        try:
            _in_dispatch(body)
        finally:
            gc.set_threshold(*thresholds)
        abs(0)  # the caller has run its own bytecode again: the guard has left
        hook = G._leave_hook()
        assert rearmed[0] > 100 and seen == {id(hook)}, (rearmed, len(seen))
        assert not guard.on_stack and sys.getprofile() is None
        assert G._leave_hook() is hook and hook.target is None  # kept by the thread, disarmed
