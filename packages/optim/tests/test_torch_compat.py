"""Pins the torch internals read by ``shardkit.optim._torch_compat`` (shared by ddp/overlap)."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import profiler_range, queue_end_of_backward
from shardkit.partition import all_gather_objects
from shardkit.testing import world
from torch import nn


def test_queue_callback_runs_after_every_hook() -> None:
    """Once per backward, after every param's post-accumulate-grad hook of the pass."""
    events: list[str] = []
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    unused = torch.nn.Parameter(torch.ones(3))

    def hook(p: torch.Tensor) -> None:
        events.append("a" if p is a else "b")
        if len(events) == 1:
            queue_end_of_backward(lambda: events.append("end"))

    for p in (a, b, unused):
        p.register_post_accumulate_grad_hook(hook)
    ((a * 2).sum() + (b * 3).sum()).backward()
    assert sorted(events[:2]) == ["a", "b"] and events[2:] == ["end"]
    events.clear()
    (a * 2).sum().backward()
    assert events == ["a", "end"]


def test_queue_callback_from_a_tensor_hook_runs_after_it() -> None:
    order: list[str] = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> None:
        queue_end_of_backward(lambda: order.append("callback"))
        order.append("hook")

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert order == ["hook", "callback"]


def test_profiling_flag_follows_the_profiler() -> None:
    """Pins ``torch._C._autograd._profiler_enabled``: true under both profiler entry points
    while they run, on this thread and in a backward's hooks; ranges open only then."""
    from shardkit.optim._torch_compat import profiling

    assert profiling() is False
    assert isinstance(profiler_range("x"), type(profiler_range("y")))  # the shared no-op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert profiling() is True
        with profiler_range("shardkit.test.phase", 3):
            torch.ones(1).add_(1)
    assert profiling() is False
    assert "shardkit.test.phase[3]" in {e.name for e in prof.events()}
    with torch.autograd.profiler.profile():
        assert profiling() is True
        seen: list[bool] = []
        w = torch.ones(2, requires_grad=True)
        w.register_hook(lambda g: seen.append(profiling()))
        w.sum().backward()
        assert seen == [True]
    assert profiling() is False


def test_profiling_without_the_flag_opens_ranges_and_logs_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkit.optim._torch_compat as compat

    monkeypatch.setattr(compat, "_logged_no_flag", False)
    with caplog.at_level(logging.INFO, logger="shardkit.optim"):
        assert compat._profiling_fallback() is True and compat._profiling_fallback() is True
    found = [
        r.getMessage() for r in caplog.records if "_profiler_enabled is gone" in r.getMessage()
    ]
    assert len(found) == 1, found


@world(2, timeout=60)
def test_default_store_is_shared_by_the_ranks() -> None:
    """Pins ``torch.distributed.distributed_c10d._get_default_store`` (read by
    ``default_store()``) and the Store behaviour the call agreement relies on (see [Note:
    Agreement over the store] in ``shardkit.optim._agreement``)."""
    from shardkit.optim._torch_compat import default_store

    rank = dist.get_rank()
    base = default_store()
    assert isinstance(base, dist.Store)
    prefix = all_gather_objects(uuid.uuid4().hex if rank == 0 else None, dist.group.WORLD)[0]
    store = dist.PrefixStore(f"pin/{prefix}/", base)
    # One store, seen by every rank; multi_get answers in the order asked.
    store.set(f"hello/{rank}", str(rank))
    store.wait(["hello/0", "hello/1"], timedelta(seconds=30))
    assert store.multi_get(["hello/1", "hello/0"]) == [b"1", b"0"]
    # clone(): another client of the same store.
    clone = dist.PrefixStore(f"pin/{prefix}/", base.clone())
    assert clone.get("hello/0") == b"0"
    # compare_set(key, "", value) on a missing key: the first writer wins, every rank reads the
    # winner's value; on an existing key it only reads.
    won = store.compare_set("slot", "", f"r{rank}")
    assert won in (b"r0", b"r1")
    assert len(set(all_gather_objects(won, dist.group.WORLD))) == 1
    assert store.compare_set("slot", "", "late") == won
    # A wait that times out raises a RuntimeError (DistStoreError) and the client stays usable.
    with pytest.raises(RuntimeError):
        clone.wait(["never"], timedelta(milliseconds=200))
    assert clone.check(["hello/1"]) and not clone.check(["never"])
    dist.barrier()
    if rank == 0:
        store.delete_key("slot")  # (its return value differs between stores: not relied on)
    dist.barrier()
    assert not store.check(["slot"])


def test_version_counter_pin() -> None:
    """What [Note: Params written outside the optimizer] relies on: every in-place write to a
    param (``copy_``, ``load_state_dict``, ``nn.init``, an op on a view of it) bumps its
    version; a write to the flat buffer it was re-pointed into, or a read, does not."""
    from shardkit.optim._torch_compat import tensor_version

    buf = torch.zeros(8)
    layer = nn.Linear(2, 2)
    p = layer.weight
    p.data = buf[:4].view(2, 2)  # as a flat bucket re-points a param
    seen = tensor_version(p)
    buf.add_(1)
    (p * 2).sum()
    assert tensor_version(p) == seen
    for write in (
        lambda: p.mul_(1.0),
        lambda: layer.load_state_dict(nn.Linear(2, 2).state_dict()),
        lambda: nn.init.zeros_(p),
        lambda: p[0].copy_(torch.ones(2)),
    ):
        with torch.no_grad():
            write()
        assert tensor_version(p) > seen
        seen = tensor_version(p)


def test_no_function_modes_sets_the_stack_aside() -> None:
    """``no_function_modes``: inside, no mode sees a call and the stack is empty; after, the
    same modes in the same order, also when the body raises."""
    from shardkit.optim._torch_compat import no_function_modes
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.calls += 1
            return func(*args, **(kwargs or {}))

    a, b = Count(), Count()
    with a, b:
        before = list(_get_current_function_mode_stack())
        with no_function_modes():
            assert list(_get_current_function_mode_stack()) == []
            torch.ones(2).add(1)
        assert a.calls == b.calls == 0
        with pytest.raises(RuntimeError, match="boom"), no_function_modes():
            raise RuntimeError("boom")
        assert list(_get_current_function_mode_stack()) == before == [a, b]
        torch.ones(2).add(1)
    assert b.calls > 0


def test_inductor_options_keeps_the_known_ones(caplog: pytest.LogCaptureFixture) -> None:
    """``inductor_options`` keeps the options this torch's inductor has (nested ones by dotted
    name, as ``torch.compile(options=)`` takes them) and leaves out, logged once, the others;
    the kept ones compile."""
    import shardkit.optim._torch_compat as compat

    wanted = {
        "cpp.enable_floating_point_contract_flag": "off",
        "eager_numerics.division_rounding": True,
        "no_such_group.no_such_option": 1,
        "no_such_option_at_all": 2,
    }
    with caplog.at_level(logging.INFO, logger="shardkit.optim"):
        kept = compat.inductor_options(wanted)
        assert compat.inductor_options(wanted) == kept
    assert kept == {
        "cpp.enable_floating_point_contract_flag": "off",
        "eager_numerics.division_rounding": True,  # in torch 2.13; the kernel relies on it
    }
    logged = [r.getMessage() for r in caplog.records if "has no option" in r.getMessage()]
    assert len(logged) == 2 and "no_such_option_at_all" in logged[1]
    fn = torch.compile(lambda x: x / 3.0, fullgraph=True, options=kept)
    assert torch.equal(fn(torch.ones(4)), torch.ones(4) / 3.0)
