"""The param all-gathers of ``ShardedDataParallel``, overlapped with the next forward, and the
param-access guard that keeps them invisible.

[Note: Deferred param gather]
With ``overlap_param_gather`` (default) the all-gathers of a step stay in flight when ``step()``
returns, issued in *reverse* bucket order (buckets are planned in reverse registration order,
so this is roughly the order forward needs them; the order is the same on every rank). A
pending gather is waited on (and forgotten) by the forward pre-hook of each submodule that
holds params of that bucket (FSDP2's pre-forward unshard, Megatron's ``overlap_param_gather``),
and, for every other access, by the param-access guard ([Note: Param access guard] below):
any torch function on the training thread that touches the storage of a pending bucket waits
for it first, so reads and writes between ``step()`` and the next
forward, or in a forward on a path no pre-hook covers, see what DDP would show. The wrapper's
own entry points that read every param (the next step, clipping, ``wait_params()``,
``state_dict()`` / ``load_state_dict()`` of any module holding params, ``copy.deepcopy``, the
optimizer's state dicts and checkpoints) wait for all of them at once. ``zero_grad()`` touches
no param and does not wait (the usual loop calls it right before the forward the gathers
overlap). A bucket whose params nothing touches is waited for by the next step at the latest.

[Note: Gloo gathers and the profiler]
torch's profiler (2.13, CPU) can crash the process (SIGSEGV or abort, in ``key_averages()`` or
when the profiler stops) when a Gloo collective launched while it profiles is still in flight
when it stops: Gloo runs the collective on a worker thread of its own, which records its
profiler event there. Plain torch shows it (a world-2 loop of ``with profile(): w =
dist.all_gather(outs, x, async_op=True)`` then ``w.wait()`` after the ``with``: 2 crashes in 3
runs of 100 iterations; a collective launched *before* the profiler starts: none in 300). A
deferred gather is exactly that when a profile ends after ``step()``, as
``torch.profiler.schedule`` ends its window in ``prof.step()`` after the optimizer's step. So on
Gloo, ``step()`` issued while a profiler runs waits for its gathers before it returns (logged
once); without a profiler, and on NCCL (its collectives are recorded on the launching thread),
gathers stay deferred.

[Note: Param access guard]
With ``overlap_param_gather`` (default) ``step()`` returns while the param all-gathers are still
in flight ([Note: Deferred param gather]). Until a bucket's gather
is waited for, the ranges of its flat buffer that other ranks own hold the previous step's
values, and a write there would be overwritten when the gather lands. DDP, FSDP2 and DeepSpeed
have no such window, so a user's read or write in it must not see one either: an EMA update, a
norm logged after ``step()``, ``p.clamp_()`` (WGAN), ``load_state_dict``, or a forward that
reads a param through another path than its module (a functional head, a tied weight).

So from the end of ``step()`` until the last pending gather is waited for, a
``TorchFunctionMode`` (:class:`_ParamGuard`) sits on the training thread's torch-function mode
stack. Every torch function called on that thread passes through it (torch ops, tensor
methods, ``.detach()``, ``.numpy()``, ``.tolist()``, ``foreach`` ops, in-place writes,
``copy_`` in ``load_state_dict``, ``untyped_storage()`` in ``torch.save`` / DCP): before the op
runs, each tensor among its arguments (and one level of lists / tuples, and keyword arguments
such as ``out=``) is matched by its *storage*, not its identity: its ``data_ptr()`` is looked
up among the byte ranges of the flat buffers, so a param, any view of it, ``p.data``, a
``detach()`` alias or a reference captured before the step are all recognised. If its bucket's
gather is pending, the guard waits for that gather first. Only metadata reads that touch no
values (property getters such as ``.shape`` / ``.grad`` / ``.data`` (an alias, itself guarded
when used), ``size()``, ``stride()``, ``numel()``, ``__hash__``, hook registration) pass without
waiting. The per-module forward pre-hooks still wait for each module's own buckets first, in
forward order; the guard catches everything else, on any path, in every forward, not only a
probed first one.

One guard per thread serves every wrapper (:func:`arm` registers a wrapper's gathers with
the guard of the thread that steps it): it is pushed at the end of a ``step()`` that leaves
gathers in flight. While it is on the stack with nothing pending it only forwards each call.
Every few calls it also polls the pending works and forgets the finished ones (a finished work
needs no wait).

[Note: The window belongs to the wrapper]
The window is the wrapper's, not the process's: the guard holds each wrapper's gathers
*weakly* (:attr:`_ParamGuard.refs`): nothing the guard (a thread-local that lives as long as
its thread) holds keeps a wrapper, its optimizers or its model alive. So:

- the guard stops inspecting as soon as the last pending gather is complete, whoever waited
  for it (a pre-hook, the guard itself, a poll that found it finished, ``wait_params()``, a
  step);
- it leaves the stack at the next point where no torch function of it is running: a wrapper's
  entry point (a forward pre-hook, ``wait_params()``, a step), ``ShardedDataParallel.close()``,
  or the collection of a wrapper's gathers (a weakref callback and a finaliser), wherever it
  sits in the stack (the user may have entered modes above it; see
  ``shardkit.optim._torch_compat``). It cannot leave from inside its own call (torch pushes a
  mode back when its ``__torch_function__`` returns): when its own call (a wait, or a poll
  that found the works finished) completed the last pending gather, it leaves as soon as the
  caller's code runs again, as after a collection ([Note: Leaving after a collection]);
- a finished model is collected after ``del ddp, opt, model; gc.collect()`` with no other call:
  the collected gather's finaliser waits for its works still in flight first (the backends
  keep the buffers they write alive anyway), so nothing is freed while a gather writes into it,
  and the guard leaves before the caller's next call ([Note: Leaving after a collection]).

[Note: Leaving after a collection]
The guard leaves the stack at points where no torch call of this thread is under way; two
events that end its window happen at other points: its own call completed the last gather
(torch pushes the guard back when that call returns), or a collection. A collection runs
wherever the interpreter allocates, also inside a torch call between torch's
check that a mode is on the stack and its pop of that mode (Python's ``handle_torch_function``
and the C++ argument parser both allocate there). Taking the guard off the stack at that moment
would empty the stack under that pop ("trying to pop from empty mode stack") or leave the call
without an implementation. So neither touches the stack itself: each installs a one-shot
profile function on the guard's thread (:func:`leave_when_safe`) that takes
the guard off at the first point where the frame the event interrupted (the innermost one
outside this package, ``weakref`` and ``torch.overrides``), or one of its callers, runs its
own bytecode again (a call it makes, or the return of a C function it
called), with no frame of ``torch.overrides`` on the stack: by then the call the collection
interrupted has finished, with any dispatch in it (torch's C++ dispatch runs no Python frame
between its check and its pop; its Python one runs in ``torch.overrides``). After ``del ddp,
opt, model; gc.collect()`` that is the caller's next call. Where another profile function is
installed (a profiler or a debugger: it is never replaced) or the collection ran on another
thread, the guard leaves at the next entry point of a wrapper on its thread, forwarding calls
meanwhile (logged once).

[Note: One profile object per thread]
The profile function of [Note: Leaving after a collection] is one object per thread
(:func:`_leave_hook`), kept alive by the thread's own reference and re-armed in place, never
replaced by a new object. CPython (3.11) reads the installed profile object as a borrowed
pointer before it calls it, and allocates in between (the frame object of the event, the
frame's locals): a collection there may run a weakref callback of ours that re-arms or clears
the profile. Had that dropped the object's last reference, the interpreter then called freed
memory: a rank died with SIGSEGV in an unrelated ``dist.broadcast`` a few tests later
(the core showed ``profile_trampoline`` calling a freed object while the thread's profile was
another one). With one object per thread, held beside the interpreter's reference,
``sys.setprofile`` from a collection never frees the object it may be about to call.

Params inside ``torch.func`` transforms (``grad_and_value(f)(dict(model.named_parameters()))``,
``vmap``, ``jacrev``) are functorch wrappers without storage of their own: the guard unwraps
them to the tensor they wrap (``shardkit.optim._torch_compat.functorch_base``) and matches that.
What it cannot see: another thread (the mode stack is per thread), a raw pointer taken before
the step and used later (``data_ptr()`` itself is guarded), C++ / CUDA extensions that read the
params without a torch function, tensor subclasses of the user's that wrap a param view (their
inner ops run inside the guard's own call), and ``torch._C.DisableTorchFunction`` regions. Call
``ddp.wait_params()`` before any of these (or pass ``overlap_param_gather=False``).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import weakref
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import CodeType, FrameType
from typing import Any, Protocol

import torch
from shardkit.optim._codecs import BlockFormat
from shardkit.optim._flat import FlatBucket
from shardkit.optim._lifecycle import GroupLife
from shardkit.optim._placeholders import METADATA_READS
from shardkit.optim._profiling import NO_RANGE
from shardkit.optim._profiling import zero2_phase as phase
from shardkit.optim._torch_compat import (
    function_mode_at,
    function_mode_count,
    functorch_base,
    pop_function_mode,
    profiling,
    push_function_mode,
    remove_function_mode,
)
from shardkit.optim._wire import Wire, _Pending
from torch import nn
from torch.overrides import TorchFunctionMode

__all__: list[str] = []

logger = logging.getLogger("shardkit.optim")

# ---------------------------------------------------------------- the param-access guard

# Torch functions that read no values of their tensor arguments and return no new storage:
# they never wait. A property getter (``__get__``) returns metadata or an alias (``.data``,
# ``.T``, ``.real``), which is guarded in turn when an op uses it.
_NO_VALUES = METADATA_READS | {
    "__get__",
    "__set__",
    "is_signed",
    "is_inference",
    "get_device",
    "requires_grad_",
    "retain_grad",
    "register_hook",
    "register_post_accumulate_grad_hook",
}
_PLAIN = (torch.Tensor, nn.Parameter)


class _Spans:
    """The byte ranges of the flat buffers, sorted: which bucket a ``data_ptr()`` falls in."""

    def __init__(self, flats: Iterable[tuple[int, torch.Tensor]]) -> None:
        spans = sorted(
            (flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size(), index)
            for index, flat in flats
            if flat.numel() > 0
        )
        self.starts = [s for s, _, _ in spans]
        self.ends = [e for _, e, _ in spans]
        self.indices = [i for _, _, i in spans]

    def bucket_at(self, ptr: int) -> int | None:
        k = bisect_right(self.starts, ptr) - 1
        return self.indices[k] if k >= 0 and ptr < self.ends[k] else None


_POLL = 32
"""Every this many inspected calls, the guard forgets the gathers that have finished."""

# [Note: The guard polls on tensor calls]
# The poll counts only the calls with a tensor among their arguments. The others (torch's
# profiler ranges, ``torch.no_grad()``'s ``_set_grad_enabled``, factories such as
# ``torch.ones(3)``) touch no param, and ``step()`` itself makes some of them after it armed
# the guard: the range ``Optimizer.step`` opens around every step closes there. Counted, they
# would run the poll inside ``step()``, and whether the guard is still on the stack when
# ``step()`` returns would depend on how fast the backend finished the gathers (the CI run of
# 1431201 met it). A user's own loop polls on its tensor ops, as before.


class _Gathers(Protocol):
    """What the guard needs of one wrapper's param gathers (:class:`_ParamGather`)."""

    @property
    def spans(self) -> _Spans: ...

    @property
    def pending(self) -> Mapping[int, Any]: ...

    def wait(self, index: int) -> None: ...

    def forget_finished(self) -> None: ...


class _ParamGuard(TorchFunctionMode):
    """Waits for a pending param gather before a torch function touches its bucket.

    See [Note: Param access guard]. One per thread (:func:`arm`), shared by every wrapper.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[_Gathers]] = []
        """The wrappers' gathers with something pending, held weakly ([Note: The window
        belongs to the wrapper])."""
        self.on_stack = False
        self.thread = threading.get_ident()
        """The thread whose mode stack this guard sits on (it is that thread's guard)."""
        self.depth = 0
        """How many of this guard's calls are running (the mode is off the stack meanwhile)."""
        self.calls = 0
        """Torch functions that passed through since construction (for the benchmarks)."""
        self.inspected = 0
        """Of those, the ones with a tensor among their arguments, matched against pending
        buckets (what the poll counts: see [Note: The guard polls on tensor calls])."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        self.calls += 1
        if self.refs and getattr(func, "__name__", None) not in _NO_VALUES:
            self.depth += 1
            try:
                gathers = [g for r in self.refs if (g := r()) is not None]
                tensors = False
                for a in args:
                    tensors |= _touch(gathers, a)
                for a in kwargs.values():
                    tensors |= _touch(gathers, a)
                if tensors:  # See [Note: The guard polls on tensor calls]
                    self.inspected += 1
                    if self.inspected % _POLL == 0:
                        for g in gathers:
                            g.forget_finished()
            finally:
                self.depth -= 1
            if not self.refs:  # this call completed the last gather
                leave_when_safe()  # See [Note: Leaving after a collection]
        return func(*args, **kwargs)

    @property
    def gathers(self) -> list[_Gathers]:
        """The live gathers registered (see :attr:`refs`)."""
        return [g for r in self.refs if (g := r()) is not None]


_local = threading.local()


def arm(gather: _Gathers) -> _ParamGuard:
    """Registers ``gather`` (which has gathers pending) with this thread's guard and pushes the
    guard on this thread's mode stack if it is not there; returns the guard."""
    guard: _ParamGuard | None = getattr(_local, "guard", None)
    if guard is None:
        guard = _local.guard = _ParamGuard()
    if all(r() is not gather for r in guard.refs):
        guard.refs.append(weakref.ref(gather, functools.partial(_forget_collected, guard)))
    if not guard.on_stack:
        push_function_mode(guard)
        guard.on_stack = True
    return guard


def disarm(guard: _ParamGuard, gather: _Gathers) -> None:
    """Unregisters ``gather`` (nothing pending any more) from ``guard``; :func:`settle` takes
    the guard off the stack at the next entry point once no gather is registered. With
    :func:`arm`, the only writer of the guard's list."""
    guard.refs = [r for r in guard.refs if r() is not gather and r() is not None]


def _forget_collected(guard: _ParamGuard, ref: weakref.ref[_Gathers]) -> None:
    """A registered gather was collected (its wrapper and optimizer are gone): forgets it; the
    guard leaves the stack once the collection's caller is past it if it was the last one
    ([Note: The window belongs to the wrapper], [Note: Leaving after a collection])."""
    guard.refs = [r for r in guard.refs if r is not ref]
    leave_when_safe()


_logged_deferred = False


def leave_when_safe() -> None:
    """Takes this thread's guard off its mode stack at the next point where no torch dispatch
    is under way, if nothing is pending then: called where that cannot be done at once (the
    garbage collector's callbacks, the guard's own call). See [Note: Leaving after a
    collection]."""
    global _logged_deferred
    guard: _ParamGuard | None = getattr(_local, "guard", None)
    if guard is None or not guard.on_stack or guard.refs:
        return
    hook = _leave_hook()
    profile = sys.getprofile()
    if guard.thread != threading.get_ident() or not (profile is None or profile is hook):
        if not _logged_deferred:
            _logged_deferred = True
            logger.info(
                "ShardedDataParallel's param-access guard could not schedule its leave (a "
                "collection on another thread, or another profile function installed): it "
                "stays on the training thread's torch-function mode stack, forwarding calls, "
                "until the next forward, step() or wait_params() there (see [Note: Leaving "
                "after a collection] )"
            )
        return
    hook.target = (guard, _interrupted())  # in place: see [Note: One profile object per thread]
    if profile is None:
        sys.setprofile(hook)


def _leave_hook() -> _LeaveAtReturn:
    """This thread's profile function object, made once and kept by the thread (see [Note: One
    profile object per thread])."""
    hook: _LeaveAtReturn | None = getattr(_local, "leave_hook", None)
    if hook is None:
        hook = _local.leave_hook = _LeaveAtReturn()
    return hook


_OWN_MODULES = ("shardkit.optim", "weakref", "torch.overrides")


def _interrupted() -> frozenset[tuple[int, CodeType]]:
    """The frame the event interrupted (the innermost one not of this package, of ``weakref``,
    whose callbacks run it, or of ``torch.overrides``, whose dispatch runs the guard) and its
    callers, by identity and code (codes outlive frames: no frame is kept alive)."""
    frame: FrameType | None = sys._getframe(1)  # noqa: SLF001 (Python's own frame access)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_OWN_MODULES):
        frame = frame.f_back
    frames: set[tuple[int, CodeType]] = set()
    while frame is not None:
        frames.add((id(frame), frame.f_code))
        frame = frame.f_back
    return frozenset(frames)


_DISPATCH_FILE = torch.overrides.__file__
_CALLER_EVENTS = frozenset({"call", "c_call", "c_return"})


class _LeaveAtReturn:
    """The one-shot profile function of [Note: Leaving after a collection]: one per thread,
    re-armed in place ([Note: One profile object per thread])."""

    def __init__(self) -> None:
        self.target: tuple[_ParamGuard, frozenset[tuple[int, CodeType]]] | None = None
        """The guard to take off and the frames whose own bytecode marks the safe point (one
        attribute, so that a re-arm from a collection inside a call is seen whole)."""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        target = self.target
        if target is None:
            self.disarm()
            return
        guard, frames = target
        # The caller's bytecode runs again: a call from it (of a C or a Python function) or
        # the return of a C function it called. A function called by C code (a dunder of an
        # argument while torch parses them) looks called by that frame too, but torch checks
        # the stack only after parsing; the dispatch itself runs no Python frame outside
        # torch.overrides.
        caller = frame.f_back if event == "call" else frame
        if event not in _CALLER_EVENTS or caller is None:
            return
        if (id(caller), caller.f_code) not in frames:
            return
        outer: FrameType | None = frame
        while outer is not None:
            if outer.f_code.co_filename == _DISPATCH_FILE:
                return  # inside a dispatch of torch.overrides: wait for it to return
            outer = outer.f_back
        if guard.refs or not guard.on_stack:
            self.disarm()  # a wrapper armed it again, or it left already
        elif not guard.depth and _take_off(guard):
            guard.on_stack = False
            self.disarm()

    def disarm(self) -> None:
        """Uninstalls the profile function (the thread keeps the object)."""
        self.target = None
        sys.setprofile(None)


def settle() -> None:
    """Takes this thread's guard off its mode stack if no gather is pending (at the wrappers'
    own entry points, at ``close()`` and when a wrapper's gathers are collected: inside one of
    the guard's calls the mode is off the stack and stays on it)."""
    guard: _ParamGuard | None = getattr(_local, "guard", None)
    if guard is not None:
        _leave(guard)


def _leave(guard: _ParamGuard) -> None:
    if guard.on_stack and not guard.refs and not guard.depth and _take_off(guard):
        guard.on_stack = False
        hook = sys.getprofile()
        if type(hook) is _LeaveAtReturn:
            hook.disarm()  # a collection's deferred leave: done here already


def _take_off(guard: _ParamGuard) -> bool:
    """Takes ``guard`` off this thread's mode stack: one pop when it is the top mode (the
    usual case), else from under the modes the user entered above it. Returns whether it was
    on the stack."""
    depth = function_mode_count()
    if depth and function_mode_at(depth - 1) is guard:
        pop_function_mode()
        return True
    return remove_function_mode(guard)


def _touch(gathers: list[_Gathers], a: Any) -> bool:
    """Waits for the pending gather of every bucket ``a`` (a tensor, or a list / tuple of
    them) points into; returns whether ``a`` is or holds a tensor."""
    if type(a) in _PLAIN:
        _wait_for(gathers, a)
        return True
    seen = False
    if type(a) is list or type(a) is tuple:
        for t in a:
            if type(t) in _PLAIN:
                _wait_for(gathers, t)
                seen = True
    return seen


def _wait_for(gathers: list[_Gathers], t: torch.Tensor) -> None:
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # no storage: a torch.func wrapper, else not a view of a flat buffer
        base = functorch_base(t)
        if base is None:
            return
        try:
            ptr = base.data_ptr()
        except RuntimeError:
            return
    for g in gathers:
        index = g.spans.bucket_at(ptr)
        if index is not None and index in g.pending:
            g.wait(index)


# ---------------------------------------------------------------- the gathers
_logged_profiling = False


class _ParamGather:
    """Issues and waits for the param all-gathers of one bucket group's buckets; see [Note:
    Deferred param gather]. Built by its :class:`~shardkit.optim._bucket_group.BucketGroup`
    with each bucket layout.

    Args:
        comm: The wrapper's communication layer.
        overlap: ``overlap_param_gather``: leave the gathers in flight after ``issue``.
        module_buckets: Buckets (indices) of the params each module owns directly.
        buckets: The group's buckets (their flat buffers are what the guard watches).
        life: The group's state machine, which records the pending gathers ([Note: Bucket
            group state] in ``shardkit.optim._lifecycle``).
        deltas: With a quantized param wire, its block format and what writes a bucket's
            ``exact - replica`` of this rank's range (``ShardStepper.delta_shard``): the
            gathers move weight deltas ([Note: Weight deltas] in ``shardkit.optim._wire``).
    """

    def __init__(
        self,
        comm: Wire,
        overlap: bool,
        module_buckets: dict[nn.Module, list[int]],
        buckets: Sequence[FlatBucket],
        life: GroupLife,
        deltas: tuple[BlockFormat, Callable[[FlatBucket, torch.Tensor], None]] | None = None,
    ) -> None:
        self.comm = comm
        self.deltas = deltas
        if deltas is not None:
            for b in buckets:
                comm.reserve_deltas(deltas[0], b.device, b.numel)
        self.overlap = overlap
        self.life = life
        self.module_buckets = module_buckets
        """Buckets of the params each module owns directly (``recurse=False``)."""
        self.buckets = list(buckets)
        self.spans = _Spans((b.index, b.flat) for b in buckets)
        """Byte ranges of the flat buffers, read again at every :meth:`issue` (see [Note:
        Param access guard])."""
        self.guard: _ParamGuard | None = None
        """The guard this gather is registered with while something is pending."""
        # See [Note: The window belongs to the wrapper]
        collected = weakref.finalize(self, _collected, comm, life.gathers)
        collected.atexit = False

    @property
    def pending(self) -> Mapping[int, _Pending]:
        """The pending gathers, by bucket index (the state machine's record)."""
        return self.life.gathers

    def issue(self, buckets: Sequence[FlatBucket]) -> None:
        """All-gathers every rank's range of ``buckets`` (async); waits at once unless
        overlapped (or on Gloo under a profiler: [Note: Gloo gathers and the profiler]), else
        arms the guard ([Note: Param access guard])."""
        # The buckets' storage may have moved since the last step (``share_memory()``, a state
        # dict pickled through a multiprocessing queue): the spans are read again each time.
        self.spans = _Spans((b.index, b.flat) for b in self.buckets)
        with torch.no_grad():
            for b in reversed(buckets):
                # In place: this rank's range is both the input and its own output chunk (NCCL
                # supports it; Gloo gathers into a buffer of its own and copies back). Nothing
                # writes the range before the gather is waited for: the guard makes every
                # access wait first.
                if self.deltas is None:
                    rank = self.comm.rank
                    own = b.flat[rank * b.shard : (rank + 1) * b.shard]
                    work = self.comm.all_gather(b.flat, own, b.index)
                else:
                    fmt, delta = self.deltas
                    work = self.comm.all_gather_deltas(
                        b.flat, fmt, functools.partial(delta, b), b.index
                    )
                self.life.gather_issued(b.index, work)
        if not self.overlap or (self.comm.gloo and profiling()):
            if self.overlap:
                _log_profiling_once()
            self.wait_all()
        elif self.pending:
            self.guard = arm(self)

    def wait(self, index: int) -> None:
        """Waits for bucket ``index``'s gather if it is pending."""
        if index in self.life.gathers:
            with phase("wait_params", index) if profiling() else NO_RANGE:
                self.comm.wait(self.life.gather_done(index))
            self._drained()

    def wait_all(self) -> None:
        """Waits for every gather still in flight."""
        if self.pending:
            with phase("wait_params") if profiling() else NO_RANGE:
                # one at a time, the pending set read again each time: a wait can complete
                # others (the guard's poll runs on any torch call a completion makes)
                while self.pending:
                    self.comm.wait(self.life.gather_done(max(self.pending)))
            self._drained()
        settle()

    def before_module(self, module: nn.Module) -> None:
        """Forward pre-hook body: waits for the buckets ``module``'s own params are in."""
        if self.pending:
            for index in self.module_buckets.get(module, ()):
                self.wait(index)
        settle()

    def forget_finished(self) -> None:
        """Forgets the gathers whose work has finished (nothing to wait for): a wrapper whose
        last gathers nothing touches leaves the guard ([Note: Param access guard])."""
        for index, pending in list(self.pending.items()):
            if pending.done():
                self.wait(index)

    def _drained(self) -> None:
        if not self.pending:
            if self.guard is not None:
                disarm(self.guard, self)
                self.guard = None


def _collected(comm: Wire, pending: Mapping[int, _Pending]) -> None:
    """The gather of a collected wrapper: its works still in flight are waited for (Gloo and
    NCCL keep the buffers they write alive anyway), with nothing decoded into params nobody
    holds (a weight-delta gather's completion would run inside the collection), and the guard
    leaves the stack if nothing else is pending ([Note: Leaving after a collection])."""
    for work in list(pending.values()):
        comm.abandon(work)
    leave_when_safe()


def _log_profiling_once() -> None:
    global _logged_profiling
    if not _logged_profiling:
        _logged_profiling = True
        logger.info(
            "ShardedDataParallel on Gloo: a torch profiler is running, so step() waits for its "
            "param all-gathers instead of overlapping them with the next forward (torch's "
            "profiler can crash when a Gloo collective it saw start is still in flight when it "
            "stops; [Note: Gloo gathers and the profiler]); logged once"
        )
