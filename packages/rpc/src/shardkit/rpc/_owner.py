"""Owner side: the Python RPC entry points of :class:`shardkit.rpc.DistributedOptimizer`.

The functions prefixed ``_remote_`` run on the worker that owns the parameters, called by
:mod:`shardkit.rpc._optimizer`; each names its local optimizer
(:mod:`shardkit.rpc._local_optimizer`) by handle (see [Note: Optimizer handles]). The TorchScript
step entry point is in :mod:`shardkit.rpc._script_step`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.rpc as rpc
from shardkit.rpc import _script_step
from shardkit.rpc._local_optimizer import GroupSpec, Updates, _LocalOptimizer, _lookup, _register
from torch.futures import Future

__all__: list[str] = []


def _remote_new(
    optimizer_class: type[torch.optim.Optimizer],
    groups: list[GroupSpec],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, int, list[dict[str, Any]], bool]:
    """Build the local optimizer; returns its RRef, its handle, its group options and whether
    this worker serves steps through the TorchScript entry point (see [Note: Step requests])."""
    local = _LocalOptimizer(optimizer_class, groups, args, kwargs)
    # Read at call time (not bound at import), so a process that disables it is seen.
    compiled = _script_step.script_step is not None
    return rpc.RRef(local), _register(local), local.param_group_options(), compiled


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _remote_step(handle: int, context_id: int) -> Future[None]:
    local = _lookup(handle)
    return local.submit(lambda: local.step(context_id, None))


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _remote_step_with(handle: int, context_id: int, updates: Updates) -> Future[None]:
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
