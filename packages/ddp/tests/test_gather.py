"""Param all-gathers overlapped with the next forward (``overlap_param_gather``, default), and
the guard that makes them invisible: every torch function on the training thread that touches
a param whose gather is pending waits for that bucket first ([Note: Deferred param gather] in
``shardkit.optim._gather``, [Note: Param access guard] in ``shardkit.optim._gather``).

The post-step accesses of users (EMA, norms, clamps, load_state_dict) are checked bit for bit
against DDP in ``tests-integration/test_post_step_access_parity.py``; this module checks the
mechanism: which accesses wait, for which bucket only, and that the mode leaves the stack."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import threading
import weakref
from collections.abc import Iterator

import pytest
import shardkit.optim._gather as guard_module
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode


class _Functional(nn.Module):
    """``early`` is never called as a module: its params are read functionally by the parent
    (before any pre-hook of their owner could wait for them), and ``aux`` only from step 2 on
    (a path the first forward does not take); ``tied``'s weight is also read by ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.early = nn.Linear(6, 6)
        self.tied = nn.Linear(6, 6)
        self.aux = nn.Linear(6, 2)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        h = torch.tanh(nn.functional.linear(x, self.early.weight, self.early.bias))
        h = torch.tanh(self.tied(h))
        h = h + nn.functional.linear(h, self.tied.weight)
        out = self.head(h)
        if step >= 2:
            out = out + nn.functional.linear(h, self.aux.weight, self.aux.bias)
        return out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _stack() -> list[TorchFunctionMode]:
    """This thread's torch-function mode stack, bottom first."""
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


def _guard() -> guard_module._ParamGuard | None:
    return getattr(guard_module._local, "guard", None)


@contextlib.contextmanager
def _no_polls() -> Iterator[None]:
    """The guard's poll off: a test that counts the pending gathers after its own tensor ops
    must not have a poll forget the ones the backend happened to finish ([Note: The guard
    polls on tensor calls] in shardkit-optim)."""
    poll = guard_module._POLL
    guard_module._POLL = 1 << 62  # never reached: the count starts at 1
    try:
        yield
    finally:
        guard_module._POLL = poll


def _clean() -> list[TorchFunctionMode]:
    """No guard left on the stack by an earlier test in this reused worker; the stack."""
    guard = _guard()
    if guard is not None:
        for gather in list(guard.gathers):
            gather.wait_all()
        guard_module.settle()
    return _stack()


@pytest.mark.parametrize("overlap", [True, False])
@world(2)
def test_params_read_on_any_path_in_forward_match_ddp(overlap: bool) -> None:
    torch.manual_seed(0)
    ref_m = _Functional()
    m = copy.deepcopy(ref_m)
    ref = DDP(ref_m, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    # one bucket per param: a bucket of its own is what a functional read could find stale
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0, overlap_param_gather=overlap)
    before = _clean()
    for step in range(6):
        x, y = _batch(step)
        nn.functional.mse_loss(ref(x, step), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(sdp(x, step), y).backward()
        opt.step()
        opt.zero_grad()
        if overlap:  # every gather is left to the next access, none is forced at the step
            assert set(sdp._engine.groups[0].gather.pending) == {b.index for b in sdp._buckets}
            assert _stack() == [*before, _guard()]
        else:
            assert not sdp._engine.groups[0].gather.pending and _stack() == before
    for (n, a), b in zip(ref_m.named_parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b), n  # the guard waited for each read: no wait_params() needed
    assert not sdp._engine.groups[0].gather.pending


@world(2)
def test_an_access_waits_for_its_own_bucket_only() -> None:
    with _no_polls():  # See [Note: The guard polls on tensor calls]
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
        x = torch.randn(2, 3)
        w0, w2 = m[0].weight, m[2].weight
        alias = w0.data  # taken before the step: matched by storage, not identity
        bucket = {id(p): b.index for b in sdp._buckets for p in b.params}
        sdp(x).sum().backward()
        opt.step()
        assert len(sdp._engine.groups[0].gather.pending) == 4
        list(m.parameters())
        list(sdp.parameters())
        _ = (w0.shape, w0.grad, w0.dtype, w0.size(), w0.numel(), w0.stride(), hash(w0))
        assert (
            len(sdp._engine.groups[0].gather.pending) == 4
        )  # references and metadata read no values
        alias.sum()
        assert set(sdp._engine.groups[0].gather.pending) == {
            bucket[id(p)] for p in (m[0].bias, w2, m[2].bias)
        }
        w2.detach()[0].tolist()  # a view of a detached alias
        assert bucket[id(w2)] not in sdp._engine.groups[0].gather.pending
        opt.zero_grad()  # touches no param: the rest waits for the forward
        assert len(sdp._engine.groups[0].gather.pending) == 2
        sdp(x).sum().backward()
        assert (
            not sdp._engine.groups[0].gather.pending and sdp._engine.groups[0].gather.guard is None
        )
        opt.step()
        sdp.eval()
        with torch.no_grad():
            sdp(x)  # an eval forward waits through the pre-hooks, module by module
        assert not sdp._engine.groups[0].gather.pending


@world(2)
def test_writes_between_step_and_forward_are_kept() -> None:
    with _no_polls():  # See [Note: The guard polls on tensor calls]
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        saved = copy.deepcopy(m.state_dict())
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
        sdp(torch.randn(2, 3)).sum().backward()
        opt.step()
        assert sdp._engine.groups[0].gather.pending
        with torch.no_grad():
            m[0].weight.clamp_(-0.01, 0.01)  # WGAN's clip: other ranks' ranges included
            torch._foreach_mul_([m[0].bias.data], 0.0)
        assert len(sdp._engine.groups[0].gather.pending) == 2
        m[2].load_state_dict({k[2:]: v for k, v in saved.items() if k.startswith("2.")})
        assert not sdp._engine.groups[0].gather.pending
        for k, v in m[2].state_dict().items():
            assert torch.equal(v, saved[f"2.{k}"]), k
        assert m[0].weight.abs().max() <= 0.01 and not m[0].bias.any()


@world(2)
def test_saves_with_gathers_pending_write_the_gathered_values(tmp_path: str) -> None:
    with _no_polls():  # See [Note: The guard polls on tensor calls]
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 40), nn.Tanh(), nn.Linear(40, 3))
        ref_m = copy.deepcopy(m)
        ref, ref_opt = DDP(ref_m), torch.optim.SGD(ref_m.parameters(), lr=0.1)
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
        captured = dict(m.named_parameters())
        x = torch.randn(2, 3)
        for model, o in ((ref, ref_opt), (sdp, opt)):
            model(x).sum().backward()
            o.step()
        assert len(sdp._engine.groups[0].gather.pending) == 4
        buf = io.BytesIO()
        torch.save(captured["2.weight"], buf)  # one param, by a reference taken before the step
        buf.seek(0)
        assert torch.equal(torch.load(buf), ref_m[2].weight)
        assert len(sdp._engine.groups[0].gather.pending) == 3
        path = f"{tmp_path}/dcp-{dist.get_rank()}"
        writer = dcp.FileSystemWriter(path, thread_count=2)
        dcp.save({"w": captured["0.weight"]}, storage_writer=writer, no_dist=True)
        out = {"w": torch.empty_like(ref_m[0].weight)}
        dcp.load(out, checkpoint_id=path, no_dist=True)
        assert torch.equal(out["w"], ref_m[0].weight)


class _CountOps(TorchFunctionMode):
    """A user's own mode (a FLOP or op counter, ``torch.device(...)``), entered around a
    forward while the guard is on the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


@world(2)
def test_guard_leaves_the_stack_under_the_users_modes() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
    before = _clean()
    x = torch.randn(2, 3)
    sdp(x).sum().backward()
    opt.step()
    guard = _guard()
    assert _stack() == [*before, guard]
    with _CountOps() as counter:
        assert _stack() == [*before, guard, counter]
        loss = sdp(x).sum()  # the last pre-hook waits: the guard leaves...
        assert _stack() == [*before, counter]  # ...from under the user's mode, which stays
        loss.backward()
    assert _stack() == before
    assert counter.ops > 0
    opt.step()
    box: list[bool] = []
    thread = threading.Thread(target=lambda: box.append(guard in _stack()))
    thread.start()
    thread.join()
    assert box == [False]  # per-thread stacks: another thread is not guarded (README: wait_params)
    sdp.wait_params()
    assert _stack() == before


@pytest.mark.parametrize("path", ["c++", "python"])
@world(2)
def test_guard_leaves_right_after_the_call_that_completed_the_last_gather(path: str) -> None:
    """A torch call that reads every param after ``step()`` waits for every gather inside the
    guard's own call; the guard is off the stack by the next statement, with no wrapper call
    in between ([Note: Leaving after a collection] in shardkit.optim._gather), whichever
    dispatch path (C++ for ``torch._foreach_norm``, ``torch.overrides`` for a Python-level
    torch function) made the call."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
    before = _clean()
    for step in range(3):
        sdp(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        guard = _guard()
        assert _stack() == [*before, guard]
        params = list(m.parameters())
        if path == "c++":
            norms = torch._foreach_norm(params)
        else:
            norms = [torch.functional.norm(p) for p in params]  # Python dispatch, one per param
        assert _stack() == before, step
        assert not sdp._engine.groups[0].gather.pending
        assert all(n.isfinite() for n in norms)


@world(2)
def test_guard_is_not_armed_without_overlap() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, overlap_param_gather=False)
    before = _clean()
    sdp(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert _stack() == before and not sdp._engine.groups[0].gather.pending


@world(2)
def test_a_wrapper_whose_last_gathers_nobody_touches_leaves_the_guard() -> None:
    """Training ends after a step() and the model is dropped: its finished gathers are
    forgotten by the guard's polling, so the guard neither keeps it alive nor keeps inspecting
    every op, and one guard serves every wrapper (no pile-up over runs)."""
    before = _clean()
    for run in range(3):
        torch.manual_seed(run)
        m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
        sdp(torch.randn(2, 3)).sum().backward()
        opt.step()
        guard = _guard()
        assert guard is not None and guard.gathers == [sdp._engine.groups[0].gather]
        assert _stack() == [*before, guard]  # one guard, however many wrappers stepped
        alive = weakref.ref(sdp)
        del m, opt, sdp
        dist.barrier()  # every rank issued its gathers: they finish
        t = torch.zeros(3)
        for _ in range(4 * guard_module._POLL):
            t.add_(1)  # unrelated work on the training thread
        assert guard.gathers == []
        gc.collect()
        assert alive() is None  # see [Note: Post-accumulate hooks hold weakly] too


@world(2)
def test_calls_without_a_tensor_do_not_poll() -> None:
    """Torch calls without a tensor argument (profiler ranges, ``no_grad()``, factories) are
    not counted by the guard's poll ([Note: The guard polls on tensor calls] in
    shardkit-optim): the range ``Optimizer.step`` opens around every step closes after the
    gathers are armed, and a poll there made the guard's presence after ``step()`` depend on
    the Gloo worker's timing (the CI run of 1431201 met it)."""
    before = _clean()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
    sdp(torch.randn(2, 3)).sum().backward()
    guard = _guard()
    inspected = guard.inspected if guard is not None else 0
    opt.step()  # arms the guard, then closes the step's range
    guard = _guard()
    assert guard is not None and guard.gathers == [sdp._engine.groups[0].gather]
    assert guard.inspected == inspected  # nothing inspected since it was armed
    dist.barrier()  # every rank issued its gathers: they finish
    for _ in range(4 * guard_module._POLL):
        with torch.profiler.record_function("user range"), torch.no_grad():
            torch.ones(3)
    assert guard.inspected == inspected and guard.gathers  # still pending: nothing looked
    assert _stack() == [*before, guard]
    sdp.wait_params()
    assert _stack() == before
    sdp.close()


@world(2)
def test_a_compiled_wrapper_reads_gathered_params() -> None:
    """``torch.compile`` (AOT eager: no code generation on this box) of the wrapper with the
    gathers deferred: the compiled forward's reads go through the guard and the pre-hooks as
    the eager ones do, so the params equal DDP's bit for bit."""
    torch.manual_seed(0)
    ref_m = _Functional()
    m = copy.deepcopy(ref_m)
    ref = DDP(ref_m, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
    compiled = torch.compile(sdp, backend="aot_eager")
    _clean()
    for step in range(4):
        x, y = _batch(step)
        nn.functional.mse_loss(ref(x, step), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out = compiled(x, step)
        # every bucket the forward read was waited for (by a pre-hook or the guard); only
        # ``aux``'s, unread before step 2, may still be in flight
        aux = {b.index for b in sdp._buckets if any(p is m.aux.weight for p in b.params)}
        assert set(sdp._engine.groups[0].gather.pending) <= (aux if step < 2 else set()), step
        nn.functional.mse_loss(out, y).backward()
        opt.step()
        opt.zero_grad()
    sdp.wait_params()
    for (n, a), b in zip(ref_m.named_parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b), n
