"""Owner side: one local ``torch.optim.Optimizer`` per (DistributedOptimizer, owner worker).

Everything in this module runs on the worker that owns the parameters: the local optimizer, the
handle table that names it (see [Note: Optimizer handles]) and ``step_and_wait``, which the
TorchScript step entry point (:mod:`shardkit.rpc._script_step`) runs. The Python RPC entry points
are in :mod:`shardkit.rpc._owner`.
"""

from __future__ import annotations

import copy
import logging
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed.rpc as rpc
from shardkit.rpc._logging import log_once
from shardkit.rpc._profiling import phase
from shardkit.rpc._queue import queue_for
from shardkit.rpc._torch_compat import context_gradients
from torch.futures import Future

__all__ = ["GroupSpec", "Updates", "step_and_wait"]

_T = TypeVar("_T")

# A local group as sent by the trainer: (global group index, parameter RRefs, group options).
GroupSpec = tuple[int, list[Any], dict[str, Any]]
# Hyper-parameter changes: global group index -> {key: new value}.
Updates = dict[int, dict[str, Any]]


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
        self._queue = queue_for(self.params)

    def submit(self, work: Callable[[], _T]) -> Future[_T]:
        """Run ``work`` serialised with every other operation on these parameters; a Future."""
        return self._queue.submit(work)

    def run(self, work: Callable[[], _T]) -> _T:
        """Run ``work`` serialised with every other operation on these parameters, on this
        thread (waiting for its turn), and return its result."""
        return self._queue.run(work)

    # -- operations (always run through `submit` or `run`) --------------------------------------

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
        with phase("shardkit.rpc.owner.step"):  # See [Note: RPC profiler ranges].
            self._step(context_id, updates)

    def _step(self, context_id: int, updates: Updates | None) -> None:
        if updates:
            self.apply_updates(updates)
        grads = context_gradients(context_id, missing_ok=True)
        if not grads:
            grads = {}
            log_once(
                "no-gradients",
                logging.DEBUG,
                "shardkit.rpc: a step named distributed autograd context %d, which holds no "
                "gradient on %s; its parameters are skipped (as with grad None)",
                context_id,
                rpc.get_worker_info().name,
            )
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


# -- handles -----------------------------------------------------------------------------------

# [Note: Optimizer handles]
# Each step names the owner's `_LocalOptimizer` by a small int handle, not by its RRef: pickling
# an RRef into every step's arguments costs an RRef fork on each call (tens of microseconds on
# a step of a few hundred). Lifetime still follows the RRef: the trainer's DistributedOptimizer
# keeps the RRef returned by `_remote_new` (in `_owner`), which keeps the local optimizer alive
# on the owner; the handle table holds only weak references, so the optimizer is freed once every
# trainer holding it is gone, and its entry is pruned on the next creation.
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


def _lookup(handle: int) -> _LocalOptimizer:
    ref = _handles.get(handle)
    found = ref() if ref is not None else None
    if found is None:
        raise RuntimeError(
            f"no DistributedOptimizer with handle {handle} on {rpc.get_worker_info().name}: it "
            "was freed (its trainer-side DistributedOptimizer is gone) or this worker restarted; "
            "build a new DistributedOptimizer"
        )
    return found


def step_and_wait(handle: int, context_id: int) -> str | None:
    """One step without hyper-parameter changes, queued like every other operation, waited for on
    the calling thread. The TorchScript step entry point runs this (see [Note: Step requests]).

    Returns:
        ``None`` once the step is applied, else the failure as text (``"Type: message"`` and the
        owner's traceback), which the trainer reports as that owner's error.
    """
    try:
        local = _lookup(handle)
        local.run(lambda: local.step(context_id, None))
    except Exception as err:
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return f"{type(err).__name__}: {err}\n\nOwner traceback:\n{text}"
    return None
