"""Owner side: one local ``torch.optim.Optimizer`` per (DistributedOptimizer, owner worker).

Everything in this module runs on the worker that owns the parameters; the functions prefixed
``_remote_`` are the RPC entry points called by :mod:`shardkit.rpc._optimizer`.
"""

from __future__ import annotations

import copy
import secrets
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed.rpc as rpc
from shardkit.rpc._channel import Endpoint, serve
from shardkit.rpc._torch_compat import context_gradients
from torch.futures import Future

__all__: list[str] = []

_T = TypeVar("_T")

# A local group as sent by the trainer: (global group index, parameter RRefs, group options).
GroupSpec = tuple[int, list[Any], dict[str, Any]]
# Hyper-parameter changes: global group index -> {key: new value}.
Updates = dict[int, dict[str, Any]]


# [Note: Per-optimizer serial queue]
# Every operation on an owner's optimizer (step, state_dict, load_state_dict) goes through a
# `_SerialQueue`, which runs them one at a time in arrival order: that is what makes concurrent
# trainers exact (no two `optimizer.step()` calls interleave their read-modify-writes, and no
# step reads a `.grad` another step installed). The queue belongs to the *parameters*, not to the
# process: DistributedOptimizers whose local parameters overlap (e.g. one per trainer process,
# all over the same model, as torch's design intends) share one queue, while optimizers over
# disjoint parameters on the same worker step in parallel. torch's `_LocalOptimizer` uses one
# process-wide lock instead, and its TorchScript path uses none.
#
# The RPC entry points are `@rpc.functions.async_execution`: a request that finds the queue
# busy only enqueues its work and returns a Future, releasing the RPC server thread at once. The
# thread that found the queue idle drains it (running later arrivals too) and completes each
# Future in turn. So N concurrent trainers occupy one server thread per queue, not N, and cannot
# starve the pool that distributed autograd's backward pass also needs.


class _SerialQueue:
    """Runs submitted callables one at a time, in order, on whichever thread finds it idle."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._queue: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._draining = False

    def submit(self, work: Callable[[], _T]) -> Future[_T]:
        """Run ``work`` after every previously submitted one. See [Note: Per-optimizer serial queue]."""
        fut: Future[Any] = Future()
        with self._mutex:
            if self._draining:
                self._queue.append((work, fut))
                return fut
            self._draining = True
        # Idle queue (the common case): run inline on this RPC thread, no enqueue round trip.
        try:
            result = work()
        except BaseException as err:  # handed to the caller through its Future
            fut.set_exception(err)
        else:
            fut.set_result(result)
        self._drain()
        return fut

    def _drain(self) -> None:
        """Run what arrived while this thread held the queue, then mark it idle."""
        while True:
            with self._mutex:
                if not self._queue:
                    self._draining = False
                    return
                item, item_fut = self._queue.popleft()
            try:
                result = item()
            except BaseException as err:  # handed to the caller through its Future
                item_fut.set_exception(err)
            else:
                item_fut.set_result(result)


# id(parameter) -> (weak reference to it, its queue). Guarded by `_registry_lock`.
_registry: dict[int, tuple[weakref.ref[torch.Tensor], _SerialQueue]] = {}
_registry_lock = threading.Lock()


def _queue_for(params: list[torch.Tensor]) -> _SerialQueue:
    """The queue shared by every optimizer over any of ``params``. See [Note: Per-optimizer serial queue]."""
    with _registry_lock:
        for key in [k for k, (ref, _) in _registry.items() if ref() is None]:
            del _registry[key]
        found: list[_SerialQueue] = []
        for p in params:
            entry = _registry.get(id(p))
            if entry is not None and entry[0]() is p and all(q is not entry[1] for q in found):
                found.append(entry[1])
        if len(found) > 1:
            raise ValueError(
                "these parameters are already split between several DistributedOptimizers on "
                "this worker (each with its own step queue), so one optimizer over all of them "
                "could not be serialised against the others; give every DistributedOptimizer "
                "either the same parameters or disjoint ones"
            )
        queue = found[0] if found else _SerialQueue()
        for p in params:
            _registry[id(p)] = (weakref.ref(p), queue)
        return queue


class _LocalOptimizer:
    """The owner-side optimizer over this worker's share of the parameters."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        groups: list[GroupSpec],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._local_group: dict[int, int] = {}
        self.params: list[torch.Tensor] = []
        torch_groups: list[dict[str, Any]] = []
        seen: dict[int, int] = {}
        for local_index, (global_index, rrefs, options) in enumerate(groups):
            self._local_group[global_index] = local_index
            tensors: list[torch.Tensor] = []
            for rref in rrefs:
                value = rref.local_value()
                position = len(self.params)
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"parameter RRef at local position {position} holds a "
                        f"{type(value).__name__}, expected a torch.Tensor (e.g. nn.Parameter); "
                        "pass RRefs to parameters, e.g. [rpc.RRef(p) for p in module.parameters()]"
                    )
                if id(value) in seen:
                    raise ValueError(
                        f"the same parameter appears twice on this worker (local positions "
                        f"{seen[id(value)]} and {position}); pass each parameter RRef once"
                    )
                seen[id(value)] = position
                self.params.append(value)
                tensors.append(value)
            torch_groups.append({**options, "params": tensors})
        self.optimizer = optimizer_class(torch_groups, *args, **kwargs)
        self._queue = _queue_for(self.params)
        # Proof of access for the direct step channel; see [Note: Direct step channel].
        self.token = secrets.token_bytes(16)
        self.direct_steps = 0  # steps applied through the channel (tests read it)

    def submit(self, work: Callable[[], _T]) -> Future[_T]:
        """Run ``work`` serialised with every other operation on these parameters."""
        return self._queue.submit(work)

    # -- operations (always run through `submit`) -----------------------------------------------

    def apply_updates(self, updates: Updates | None) -> None:
        """Apply hyper-parameter changes forwarded from the trainer's ``param_groups``."""
        if not updates:
            return
        for global_index, changes in updates.items():
            local_index = self._local_group.get(global_index)
            if local_index is not None:
                self.optimizer.param_groups[local_index].update(changes)

    def step(self, context_id: int, updates: Updates | None) -> None:
        """One optimizer step with the gradients this worker holds in ``context_id``."""
        if updates:
            self.apply_updates(updates)
        grads = context_gradients(context_id, missing_ok=True) or {}
        # [Note: Gradients are lent, never left behind]
        # The context's gradients are installed as `.grad` only for the duration of
        # `optimizer.step()`, and whatever `.grad` was there before (normally None) is put back,
        # so a parameter absent from this context is skipped (grad None, like a local optimizer)
        # rather than re-applying a stale gradient, and the owner's own `.grad` is untouched.
        saved = [p.grad for p in self.params]
        try:
            for p in self.params:
                p.grad = grads.get(p)
            self.optimizer.step()
        finally:
            for p, g in zip(self.params, saved, strict=True):
                p.grad = g

    def direct_step(self, context_id: int, updates: Updates | None) -> None:
        """A step from the direct step channel's handler thread: queued like ``_remote_step``.

        See [Note: Direct step channel] and [Note: Per-optimizer serial queue].
        """

        def work() -> None:
            self.step(context_id, updates)
            self.direct_steps += 1

        self.submit(work).wait()

    def param_group_options(self) -> list[dict[str, Any]]:
        """Every local group's options (without ``params``), in local order."""
        return [
            {k: v for k, v in group.items() if k != "params"}
            for group in self.optimizer.param_groups
        ]

    def state(self) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
        """A detached copy of the per-parameter state (local position -> state) and group options.

        Copied because the reply is serialised after this returns, possibly while a later step
        already mutates the live tensors.
        """
        sd = self.optimizer.state_dict()
        state = copy.deepcopy(sd["state"])
        groups = copy.deepcopy(self.param_group_options())
        return state, groups

    def load(self, state: dict[int, dict[str, Any]], options: list[dict[str, Any]]) -> None:
        """Load per-parameter state (local positions) and group options (local order)."""
        current = self.optimizer.state_dict()["param_groups"]
        groups = [
            {**opts, "params": cur["params"]} for opts, cur in zip(options, current, strict=True)
        ]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- RPC entry points --------------------------------------------------------------------------

# [Note: Optimizer handles]
# Each step names the owner's `_LocalOptimizer` by a small int handle, not by its RRef: pickling
# an RRef into every step's arguments costs an RRef fork on each call (tens of microseconds on
# a step of a few hundred). Lifetime still follows the RRef: the trainer's DistributedOptimizer
# keeps the RRef returned by `_remote_new`, which keeps the local optimizer alive on the owner;
# the handle table holds only weak references, so the optimizer is freed once every trainer
# holding it is gone, and its entry is pruned on the next creation.
_handles: dict[int, weakref.ref[_LocalOptimizer]] = {}
_handles_lock = threading.Lock()
_next_handle = 0


def _register(local: _LocalOptimizer) -> int:
    global _next_handle
    with _handles_lock:
        for key in [k for k, ref in _handles.items() if ref() is None]:
            del _handles[key]
        _next_handle += 1
        _handles[_next_handle] = weakref.ref(local)
        return _next_handle


def _find(handle: int) -> _LocalOptimizer | None:
    ref = _handles.get(handle)
    return ref() if ref is not None else None


def _unknown_handle(handle: int) -> str:
    return (
        f"no DistributedOptimizer with handle {handle} on {rpc.get_worker_info().name}: it "
        "was freed (its trainer-side DistributedOptimizer is gone) or this worker restarted; "
        "build a new DistributedOptimizer"
    )


def _lookup(handle: int) -> _LocalOptimizer:
    found = _find(handle)
    if found is None:
        raise RuntimeError(_unknown_handle(handle))
    return found


def _remote_new(
    optimizer_class: type[torch.optim.Optimizer],
    groups: list[GroupSpec],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, int, list[dict[str, Any]], Endpoint | None, bytes | None]:
    """Build the local optimizer; returns its RRef, handle, group options and, when the direct
    step channel is on here, this process's step server endpoint and the optimizer's token."""
    local = _LocalOptimizer(optimizer_class, groups, args, kwargs)
    # See [Note: Direct step channel]; `serve` reads SHARDKIT_RPC_DIRECT_STEP.
    endpoint = serve(_find, _unknown_handle)
    token = local.token if endpoint is not None else None
    return rpc.RRef(local), _register(local), local.param_group_options(), endpoint, token


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _remote_step(handle: int, context_id: int, updates: Updates | None) -> Future[None]:
    local = _lookup(handle)
    return local.submit(lambda: local.step(context_id, updates))


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _remote_state(
    handle: int, updates: Updates | None
) -> Future[tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]]:
    local = _lookup(handle)

    def work() -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
        local.apply_updates(updates)
        return local.state()

    return local.submit(work)


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _remote_load(
    handle: int, state: dict[int, dict[str, Any]], options: list[dict[str, Any]]
) -> Future[None]:
    local = _lookup(handle)
    return local.submit(lambda: local.load(state, options))
