"""The param-access window is the wrapper's: ``close()``, ``with``, collection after training.

See shardkit-optim's [Note: The window belongs to the wrapper] and shardkit-ddp's [Note:
Closing the wrapper]. World 2 over Gloo; the training loops are compared with DDP + AdamW bit
for bit (a sum of two values does not depend on the order, and both scale by 1/2).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import shardkit.optim._gather as guard_module
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer, profiling
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import _get_current_function_mode_stack


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _depth() -> int:
    return len(_get_current_function_mode_stack())


def _clean_depth() -> int:
    """The stack's depth once an earlier test of this reused worker left nothing behind (its
    wrappers collected, the guard settled)."""
    gc.collect()
    guard = getattr(guard_module._local, "guard", None)
    if guard is not None:
        for gather in guard.gathers:
            gather.wait_all()
    guard_module.settle()
    return _depth()


def _guard_state(depth: int) -> str:
    """What an assertion on the stack's depth reports when it fails."""
    guard = getattr(guard_module._local, "guard", None)
    state = "no guard" if guard is None else (
        f"guard on_stack={guard.on_stack}, {len(guard.refs)} registered, depth={guard.depth}, "
        f"pending={[len(g.pending) for g in guard.gathers]}"
    )
    modes = [type(m).__name__ for m in _get_current_function_mode_stack()]
    return f"expected depth {depth} + 1, stack {modes}; {state}; profiling={profiling()}"


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step < steps - 1:
            opt.zero_grad()


@pytest.mark.parametrize("bucket", [0, 40, None])
@world(2)
def test_a_finished_model_is_collected_and_the_stack_restored(bucket: int | None) -> None:
    """After the last ``step()`` (gathers in flight), ``del`` + ``gc.collect()`` frees the
    model, the optimizer and the wrapper, and the mode stack is back to its depth before
    wrapping, with no other call."""
    depth = _clean_depth()
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=bucket)
    _train(sdp, opt, 3)
    assert _depth() == depth + 1  # the guard, with the last step's gathers pending
    alive = [weakref.ref(o) for o in (m, opt, sdp)]
    del m, opt, sdp
    gc.collect()
    assert [r() for r in alive] == [None, None, None]
    assert _depth() == depth
    t = torch.ones(3)
    assert torch.add(t, 1).tolist() == [2.0, 2.0, 2.0]  # the process group and torch work on
    dist.barrier()


@pytest.mark.parametrize("bucket", [0, None])
@world(2)
def test_close_ends_the_window_and_keeps_the_trained_params(bucket: int | None) -> None:
    """``with ShardedDataParallel(...)``: at the end of the block the gathers are waited for,
    the guard is off the stack, the module is plain (no hooks of the wrapper, no
    placeholders) and holds DDP's params; the process group stays."""
    depth = _clean_depth()
    ref_m = _model()
    m = copy.deepcopy(ref_m)
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    _train(DDP(ref_m), ref_opt, 3)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    with ShardedDataParallel(m, opt, reduce_buffer_size=bucket) as sdp:
        _train(sdp, opt, 3)
    assert _depth() == depth
    assert all(p.grad is None for p in m.parameters())
    assert not any(sub._forward_pre_hooks for sub in m.modules())
    for r, p in zip(ref_m.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
    plain = copy.deepcopy(m)  # the module's own deepcopy again
    x, _ = _batch(7)
    torch.testing.assert_close(plain(x), m(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="was closed"):
        sdp(x)
    with pytest.raises(RuntimeError, match="was closed"):
        opt.step()
    sdp.close()  # idempotent
    alive = weakref.ref(sdp)
    del sdp, opt
    gc.collect()
    assert alive() is None
    dist.barrier()  # the process group is the user's


@world(2)
def test_the_guard_leaves_once_the_gathers_are_waited_for() -> None:
    """The guard is on the stack only while a gather is pending: ``wait_params()`` or a
    forward ends it."""
    depth = _clean_depth()
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
    _train(sdp, opt, 2)
    assert _depth() == depth + 1, _guard_state(depth)
    sdp.wait_params()
    assert _depth() == depth
    opt.zero_grad()
    x, y = _batch(3)
    nn.functional.mse_loss(sdp(x), y).backward()
    opt.step()
    assert _depth() == depth + 1
    with torch.no_grad():
        sdp(x)  # every bucket's pre-hook waits
    assert _depth() == depth
    sdp.close()


@world(2)
def test_a_collection_inside_a_torch_call_leaves_the_call_alone() -> None:
    """A dropped wrapper is collected wherever the interpreter allocates, also inside a torch
    call between torch's check that a mode is on the stack and its pop of that mode: the guard
    leaves only once that call is over ([Note: Leaving after a collection] in shardkit-optim).
    The collection is made to run at that worst moment of ``torch.overrides``' dispatch (where
    the CI run once met an automatic one): the call goes on, then the next call in this frame
    finds the stack at its depth before wrapping."""
    import torch.overrides as overrides

    depth = _clean_depth()
    pop = overrides._pop_mode
    for run in range(2):
        m = _model()
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
        sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
        _train(sdp, opt, 2)
        assert _depth() == depth + 1
        alive = weakref.ref(sdp)
        del m, opt, sdp  # a cycle (the module's hooks hold the wrapper): left to the collector
        collections: list[int] = []

        def collect_then_pop() -> object:
            if not collections:
                collections.append(gc.collect())  # checked the stack, about to pop the guard
            return pop()

        t = torch.ones(4, requires_grad=True)
        overrides._pop_mode = collect_then_pop
        try:
            handle = t.register_hook(lambda g: 2 * g)  # dispatched in torch.overrides
        finally:
            overrides._pop_mode = pop
        assert collections and alive() is None, run
        t.sum().backward()
        handle.remove()
        assert t.grad is not None and t.grad.tolist() == [2.0] * 4
        assert _depth() == depth, run
    dist.barrier()
