"""DistributedOptimizer: the trainer-side object."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed.rpc as rpc
from shardkit.rpc._errors import RemoteOptimizerError
from shardkit.rpc._keys import param_key, remap_key, split_param_key
from shardkit.rpc._local_optimizer import GroupSpec, Updates
from shardkit.rpc._logging import log_once
from shardkit.rpc._owner import (
    _remote_load,
    _remote_new,
    _remote_state,
    _remote_step,
    _remote_step_with,
)
from shardkit.rpc._profiling import phase
from shardkit.rpc._scheduler import _DRIVER_TOKEN, ParamGroupsView
from shardkit.rpc._script_step import script_step
from shardkit.rpc._torch_compat import context_gradients, is_rref
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT
from torch.futures import Future, collect_all

__all__ = ["DistributedOptimizer"]


_DEFAULT_TIMEOUT = float(UNSET_RPC_TIMEOUT)


def _rpc_timeout(timeout: float | None) -> float:
    if timeout is None:
        return _DEFAULT_TIMEOUT
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(
            f"timeout must be a positive finite number of seconds or None (the RPC agent's "
            f"default), got {type(timeout).__name__} {timeout!r}"
        )
    return float(timeout)


def _check_rref(value: object, where: str) -> None:
    if not is_rref(value):
        raise TypeError(
            f"{where} is a {type(value).__name__} ({value!r:.80}), expected a "
            "torch.distributed.rpc.RRef to a parameter; wrap local parameters with rpc.RRef(p), "
            "or create them on the owner, e.g. [rpc.RRef(p) for p in module.parameters()] returned "
            "by an RPC to it"
        )


def _normalise_groups(params_rref: object) -> list[dict[str, Any]]:
    """``params_rref`` as torch.optim accepts it -> list of groups with a list of RRefs each."""
    if (
        is_rref(params_rref)
        or isinstance(params_rref, (torch.Tensor, dict, str))
        or not isinstance(params_rref, Iterable)
    ):
        raise TypeError(
            f"params_rref must be an iterable of parameter RRefs or of param-group dicts "
            f"({{'params': [RRef, ...], 'lr': ...}}), got {type(params_rref).__name__}; "
            "wrap a single RRef in a list"
        )
    items = list(params_rref)
    if not items:
        raise ValueError(
            "params_rref is empty: DistributedOptimizer needs at least one parameter RRef"
        )
    if not any(isinstance(item, Mapping) for item in items):
        for i, item in enumerate(items):
            _check_rref(item, f"params_rref[{i}]")
        return [{"params": items}]
    groups: list[dict[str, Any]] = []
    for g, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise TypeError(
                f"params_rref mixes param-group dicts and bare RRefs: item {g} is a "
                f"{type(item).__name__}; pass either only RRefs or only dicts"
            )
        if "params" not in item:
            raise ValueError(
                f"param group {g} has no 'params' key (keys: {sorted(map(str, item))}); "
                "each group needs {'params': [RRef, ...], ...options}"
            )
        params = item["params"]
        plist = [params] if is_rref(params) else params
        if isinstance(plist, (torch.Tensor, str, Mapping)) or not isinstance(plist, Iterable):
            raise TypeError(
                f"param group {g}: 'params' must be an RRef or an iterable of RRefs, got "
                f"{type(params).__name__}"
            )
        plist = list(plist)
        if not plist:
            raise ValueError(f"param group {g} has an empty 'params' list; drop the group")
        for i, p in enumerate(plist):
            _check_rref(p, f"param group {g} 'params'[{i}]")
        groups.append({**item, "params": plist})
    return groups


def _snapshot(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _step_call(owner: str, owner_has_script: bool) -> Callable[..., Any]:
    """The entry point for ``owner``'s steps without option changes: the TorchScript one where
    both sides compiled it, else the Python one (logged once per owner). See [Note: Step
    requests]."""
    python_step: Callable[..., Any] = _remote_step
    if script_step is None:  # this process could not compile it: logged by `_script_step`
        return python_step
    if not owner_has_script:
        log_once(
            f"python-step:{owner}",
            logging.INFO,
            "shardkit.rpc: %s has no TorchScript step entry point (TorchScript unavailable "
            "there, see its log); steps to it use Python RPC calls (same results, slower)",
            owner,
        )
        return python_step
    compiled: Callable[..., Any] = script_step
    return compiled


def _same(a: Any, b: Any, key: str = "") -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception as err:  # exotic values without a boolean ==: treat as changed
        log_once(
            f"same:{type(a).__qualname__}",
            logging.INFO,
            "shardkit.rpc: cannot compare param-group option %r values of type %s (%s: %s); it "
            "is treated as changed, so it is sent to the owners with every step",
            key,
            type(a).__qualname__,
            type(err).__name__,
            err,
        )
        return False


class DistributedOptimizer:
    """An optimizer over parameters spread across RPC workers, exact under concurrent trainers.

    Same calling convention as :class:`torch.distributed.optim.DistributedOptimizer`: one local
    ``optimizer_class`` instance is created on every worker owning some of ``params_rref``, and
    :meth:`step` applies the gradients recorded in a distributed autograd context on all owners
    concurrently, returning once all are done.

    Differences from torch's: concurrent ``step`` calls on the same owner are serialised per
    owner optimizer, so no update is lost (see [Note: Per-optimizer serial queue]); any
    ``torch.optim.Optimizer`` subclass works, without TorchScript; gradients are lent to ``.grad``
    only during the step; param groups, ``state_dict``/``load_state_dict``, LR schedulers (via
    :attr:`scheduler_view`), per-call timeouts and errors naming every failing owner.

    Everything goes over torch RPC. A :meth:`step` is one call per owner carrying the context
    id and, when options changed, the changed options only; see [Note: Step requests].

    Args:
        optimizer_class: A ``torch.optim.Optimizer`` subclass, importable on the owner workers
            (it is pickled by reference).
        params_rref: RRefs to the parameters (leaf tensors requiring grad), or a list of
            param-group dicts ``{"params": [RRef, ...], "lr": ...}`` as in ``torch.optim``.
        *args: Passed to ``optimizer_class`` on every owner.
        **kwargs: Passed to ``optimizer_class`` on every owner.

    Attributes:
        param_groups: One dict per param group: ``params`` (the RRefs) and every option as the
            owners' optimizers report them. Edits (``group["lr"] = ...``) are forwarded to every
            owner with the next :meth:`step` or :meth:`state_dict`.

    Raises:
        TypeError: ``optimizer_class`` is not an Optimizer subclass, or a param is not an RRef
            (checked before any RPC is sent).
        ValueError: empty params or malformed param groups.
        RemoteOptimizerError: the optimizer could not be built on some owners (e.g. a bad
            hyper-parameter); names every failing owner.
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: Iterable[Any],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. torch.optim.Adam), "
                f"got {type(optimizer_class).__name__} {optimizer_class!r}"
            )
        groups = _normalise_groups(params_rref)
        self.optimizer_class = optimizer_class

        # Split every group by owner, keeping first-appearance order of owners and params.
        per_owner: dict[str, list[GroupSpec]] = {}
        positions: dict[str, int] = {}
        self._keys: list[list[str]] = []
        for g, group in enumerate(groups):
            options = {k: v for k, v in group.items() if k != "params"}
            keys: list[str] = []
            for rref in group["params"]:
                owner = rref.owner_name()
                specs = per_owner.setdefault(owner, [])
                if not specs or specs[-1][0] != g:
                    specs.append((g, [], options))
                specs[-1][1].append(rref)
                position = positions.get(owner, 0)
                positions[owner] = position + 1
                keys.append(param_key(owner, position))
            self._keys.append(keys)
        self._owners: list[str] = list(per_owner)
        self._owner_groups: dict[str, list[int]] = {
            owner: [spec[0] for spec in specs] for owner, specs in per_owner.items()
        }

        calls = {
            owner: (_remote_new, (optimizer_class, specs, args, kwargs))
            for owner, specs in per_owner.items()
        }
        created = self._run("__init__", calls, float(UNSET_RPC_TIMEOUT))
        # The RRefs keep the owners' optimizers alive; steps name them by handle.
        # See [Note: Optimizer handles].
        self._owner_rrefs: dict[str, Any] = {owner: created[owner][0] for owner in self._owners}
        self._remote: dict[str, int] = {owner: created[owner][1] for owner in self._owners}
        # Per owner: (name, worker info, handle, the call for a step without option changes,
        # its profiler range name). The worker info spares `rpc_async` a name lookup per call.
        # See [Note: Step requests] and [Note: RPC profiler ranges].
        self._step_calls: list[tuple[str, Any, int, Callable[..., Any], str]] = [
            (
                owner,
                rpc.get_worker_info(owner),
                self._remote[owner],
                _step_call(owner, created[owner][3]),
                f"shardkit.rpc.step.request[{owner}]",
            )
            for owner in self._owners
        ]

        # [Note: Hyper-parameter forwarding]
        # `param_groups` on the trainer is authoritative for options. `_synced[g]` is a snapshot
        # of what every owner holding group g last received; `_collect_updates` diffs the groups
        # against it and ships only the changed keys, piggy-backed on the next step/state_dict
        # RPC, so an unchanged lr costs no extra message and a scheduler's edit reaches every
        # owner before that owner's next step. (With several trainer threads, a change reaches
        # each owner with whichever trainer's step arrives there next.)
        self.param_groups: list[dict[str, Any]] = []
        for g, group in enumerate(groups):
            owner = next(o for o in self._owners if g in self._owner_groups[o])
            local_index = self._owner_groups[owner].index(g)
            reported = created[owner][2][local_index]
            self.param_groups.append({"params": group["params"], **reported})
        self._params_lists = [group["params"] for group in self.param_groups]
        self._synced: list[dict[str, Any]] = [
            {k: _snapshot(v) for k, v in group.items() if k != "params"}
            for group in self.param_groups
        ]
        self._sync_lock = threading.Lock()
        self._view: ParamGroupsView | None = None

    # -- introspection ---------------------------------------------------------------------------

    @property
    def owners(self) -> list[str]:
        """Names of the workers holding a local optimizer, in first-appearance order."""
        return list(self._owners)

    @property
    def param_keys(self) -> list[list[str]]:
        """Per param group, the stable key of each parameter (``"<owner>:<position>"``), in the
        order given. These key :meth:`state_dict`'s ``state``; see [Note: Parameter keys]."""
        return [list(keys) for keys in self._keys]

    @property
    def scheduler_view(self) -> ParamGroupsView:
        """A ``torch.optim.Optimizer`` to hand to ``torch.optim.lr_scheduler`` classes.

        It shares :attr:`param_groups`, so scheduler changes reach every owner with the next
        step. See [Note: Scheduler view].
        """
        if self._view is None:
            defaults = {k: v for k, v in self.param_groups[0].items() if k != "params"}
            self._view = ParamGroupsView(self.param_groups, defaults)
        return self._view

    def __repr__(self) -> str:
        n = sum(len(keys) for keys in self._keys)
        return (
            f"DistributedOptimizer({self.optimizer_class.__name__}, {n} params in "
            f"{len(self._keys)} group(s) over owners {self._owners})"
        )

    # -- stepping --------------------------------------------------------------------------------

    def step(self, context_id: int, *, timeout: float | None = None) -> None:
        """Apply the gradients of distributed autograd context ``context_id`` on every owner.

        Owners step concurrently; the call returns when all are done. Concurrent calls (threads
        or other trainer processes with their own DistributedOptimizer over the same params)
        are serialised per owner, so every step is applied exactly once. Each owner gets one
        RPC with the context id (and the changed options, if any); see [Note: Step requests].

        Args:
            context_id: The id from ``with torch.distributed.autograd.context() as context_id``,
                after ``dist_autograd.backward(context_id, ...)``; the context must still be live.
            timeout: Seconds to wait for each owner (``None``: the RPC agent's default).

        Raises:
            TypeError: ``context_id`` is not an int (before any RPC is sent).
            ValueError: ``context_id`` is not a live context on this worker, or a bad ``timeout``
                (before any RPC is sent).
            RemoteOptimizerError: one or more owners failed or timed out; names all of them.
        """
        with phase("shardkit.rpc.step"):  # See [Note: RPC profiler ranges].
            self._step(context_id, timeout)

    def _step(self, context_id: int, timeout: float | None) -> None:
        rpc_timeout = _rpc_timeout(timeout)
        self._check_context(context_id)
        updates = self._collect_updates()
        # Every owner's call is started before waiting on any, so the owners step concurrently.
        # See [Note: Step requests].
        futs: dict[str, Future[Any]] = {}
        failures: dict[str, BaseException] = {}
        for owner, to, handle, call, range_name in self._step_calls:
            owner_updates = self._updates_for(owner, updates) if updates else None
            try:
                with phase(range_name):
                    if owner_updates is None:
                        args: tuple[Any, ...] = (handle, context_id)
                        fut = rpc.rpc_async(to, call, args=args, timeout=rpc_timeout)
                    else:
                        args = (handle, context_id, owner_updates)
                        fut = rpc.rpc_async(to, _remote_step_with, args=args, timeout=rpc_timeout)
            except Exception as err:  # e.g. the RPC agent is shut down or the name is unknown
                failures[owner] = err
            else:
                futs[owner] = fut
        with phase("shardkit.rpc.step.wait"):
            if len(futs) > 1:
                # Chained in C++: the trainer wakes once, when every owner answered. It completes
                # early on the first error; `_wait` then collects every owner's outcome.
                with contextlib.suppress(Exception):
                    collect_all(list(futs.values())).wait()
            self._wait(f"step(context_id={context_id})", futs, failures)
        if self._view is not None:
            self._view.step(_DRIVER_TOKEN)

    def _check_context(self, context_id: object) -> None:
        if isinstance(context_id, bool) or not isinstance(context_id, int):
            raise TypeError(
                f"context_id must be an int from `with dist_autograd.context() as context_id`, "
                f"got {type(context_id).__name__} {context_id!r:.80}"
            )
        try:
            context_gradients(context_id, missing_ok=False)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"context_id {context_id} is not a live distributed autograd context on this "
                f"worker ({err}). Call step inside `with dist_autograd.context() as context_id:` "
                "after dist_autograd.backward(context_id, [loss]), before the block exits."
            ) from None

    # -- hyper-parameters ------------------------------------------------------------------------

    def _collect_updates(self) -> Updates | None:
        """Changed options since the last forward. See [Note: Hyper-parameter forwarding]."""
        with self._sync_lock:
            if len(self.param_groups) != len(self._synced):
                raise RuntimeError(
                    f"param_groups now has {len(self.param_groups)} groups, the "
                    f"DistributedOptimizer was built with {len(self._synced)}; adding or removing "
                    "groups is not supported, build a new DistributedOptimizer instead"
                )
            updates: Updates = {}
            for g, (group, synced) in enumerate(zip(self.param_groups, self._synced, strict=True)):
                if group.get("params") is not self._params_lists[g]:
                    raise RuntimeError(
                        f"param_groups[{g}]['params'] was replaced; the parameters of a "
                        "DistributedOptimizer are fixed at construction, build a new one instead"
                    )
                # Unchanged options are usually the very objects last snapshotted (`deepcopy`
                # returns immutable values as they are), so identity settles most keys.
                changes = {
                    k: v
                    for k, v in group.items()
                    if k != "params"
                    and (k not in synced or (synced[k] is not v and not _same(synced[k], v, k)))
                }
                if changes:
                    updates[g] = changes
                    synced.update({k: _snapshot(v) for k, v in changes.items()})
            return updates or None

    def _updates_for(self, owner: str, updates: Updates | None) -> Updates | None:
        if not updates:
            return None
        mine = {g: changes for g, changes in updates.items() if g in self._owner_groups[owner]}
        return mine or None

    # -- checkpointing ---------------------------------------------------------------------------

    def state_dict(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Every owner's optimizer state in one plain, picklable structure.

        Returns:
            ``{"state": {key: per-param state}, "param_groups": [{**options, "params": [key,
            ...]}]}`` where keys are ``"<owner>:<position>"`` (see :attr:`param_keys`). Tensors
            are copies, taken between steps (never mid-step).

        Raises:
            ValueError: bad ``timeout``.
            RemoteOptimizerError: one or more owners failed or timed out.
        """
        rpc_timeout = _rpc_timeout(timeout)
        updates = self._collect_updates()
        calls = {
            owner: (_remote_state, (self._remote[owner], self._updates_for(owner, updates)))
            for owner in self._owners
        }
        results = self._run("state_dict", calls, rpc_timeout)
        state: dict[str, Any] = {}
        for owner in self._owners:
            for position, param_state in results[owner][0].items():
                state[param_key(owner, int(position))] = param_state
        groups = []
        with self._sync_lock:
            for g, group in enumerate(self.param_groups):
                options = {k: _snapshot(v) for k, v in group.items() if k != "params"}
                groups.append({**options, "params": list(self._keys[g])})
        return {"state": state, "param_groups": groups}

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any],
        *,
        owner_map: Mapping[str, str] | None = None,
        key_map: Mapping[str, str] | Callable[[str], str] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Load a :meth:`state_dict` (possibly from another run) into every owner.

        The saved param groups must hold the same parameters as this optimizer's, group by
        group, after translating saved keys: ``key_map`` (exact old key -> new key, or a
        function) is tried first, then ``owner_map`` (old owner name -> new owner name, for
        renamed workers). Options (lr, ...) are restored into :attr:`param_groups` as well.

        Raises:
            TypeError: ``state_dict`` is not shaped like :meth:`state_dict`'s output.
            ValueError: the saved parameters do not match this optimizer's (lists the missing and
                unexpected keys), or a bad ``timeout``. Nothing is sent to owners in that case.
            RemoteOptimizerError: one or more owners failed to load.
        """
        rpc_timeout = _rpc_timeout(timeout)
        saved_groups, saved_state = self._validate_saved(state_dict)
        translated_groups: list[list[str]] = [
            [remap_key(k, owner_map, key_map) for k in group["params"]] for group in saved_groups
        ]
        problems = []
        for g, (mine, theirs) in enumerate(zip(self._keys, translated_groups, strict=True)):
            if len(set(theirs)) != len(theirs):
                dupes = sorted({k for k in theirs if theirs.count(k) > 1})
                problems.append(f"group {g}: keys map to the same parameter: {dupes[:5]}")
            missing = sorted(set(mine) - set(theirs))
            unexpected = sorted(set(theirs) - set(mine))
            if missing or unexpected:
                problems.append(
                    f"group {g}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                    f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
                )
        known = {k for keys in self._keys for k in keys}
        state_by_key: dict[str, Any] = {}
        for old_key, value in saved_state.items():
            new_key = remap_key(old_key, owner_map, key_map)
            if new_key not in known:
                problems.append(f"state for {old_key!r} (-> {new_key!r}) matches no parameter")
            state_by_key[new_key] = value
        if problems:
            raise ValueError(
                "state_dict does not match this DistributedOptimizer's parameters "
                f"(its keys: {self.param_keys}):\n  " + "\n  ".join(problems[:20]) + "\n"
                "If owners were renamed pass owner_map={'old': 'new'}; if parameters moved pass "
                "key_map={'old:pos': 'new:pos'} (or a function)."
            )

        options = [{k: v for k, v in group.items() if k != "params"} for group in saved_groups]
        calls: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
        for owner in self._owners:
            local_state: dict[int, Any] = {}
            for key, value in state_by_key.items():
                key_owner, position = split_param_key(key)
                if key_owner == owner:
                    local_state[position] = value
            local_options = [options[g] for g in self._owner_groups[owner]]
            calls[owner] = (_remote_load, (self._remote[owner], local_state, local_options))
        self._run("load_state_dict", calls, rpc_timeout)
        with self._sync_lock:
            for group, synced, opts in zip(self.param_groups, self._synced, options, strict=True):
                group.update(opts)
                synced.clear()
                synced.update({k: _snapshot(v) for k, v in opts.items()})

    def _validate_saved(
        self, state_dict: object
    ) -> tuple[list[Mapping[str, Any]], Mapping[str, Any]]:
        hint = "expected the output of DistributedOptimizer.state_dict()"
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict must be a mapping, got {type(state_dict).__name__}; {hint}"
            )
        if "state" not in state_dict or "param_groups" not in state_dict:
            raise TypeError(
                f"state_dict needs 'state' and 'param_groups', got keys {sorted(map(str, state_dict))}; {hint}"
            )
        groups, state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(state, Mapping) or not isinstance(groups, (list, tuple)):
            raise TypeError(
                f"state_dict['state'] must be a mapping and ['param_groups'] a list, got "
                f"{type(state).__name__} and {type(groups).__name__}; {hint}"
            )
        if len(groups) != len(self._keys):
            raise ValueError(
                f"state_dict has {len(groups)} param group(s), this optimizer has "
                f"{len(self._keys)}; load it into an optimizer built with the same param groups"
            )
        for g, group in enumerate(groups):
            params = group.get("params") if isinstance(group, Mapping) else None
            if not isinstance(params, (list, tuple)) or not all(isinstance(k, str) for k in params):
                raise TypeError(
                    f"state_dict['param_groups'][{g}] must be a mapping whose 'params' is a list "
                    f"of str keys, got {group!r:.120}; {hint} (a torch.optim state_dict uses int "
                    "ids and cannot be loaded here)"
                )
        for key in state:
            if not isinstance(key, str):
                raise TypeError(
                    f"state_dict['state'] keys must be str '<owner>:<position>', got "
                    f"{type(key).__name__} {key!r}; {hint}"
                )
        return list(groups), state

    # -- RPC fan-out -----------------------------------------------------------------------------

    def _run(
        self,
        operation: str,
        calls: Mapping[str, tuple[Callable[..., Any], tuple[Any, ...]]],
        rpc_timeout: float,
    ) -> dict[str, Any]:
        """Start every owner's call, wait for all of them, raise one error naming all failures.

        Every call carries ``rpc_timeout``, so the wait is bounded even when an owner hangs.
        """
        futs: dict[str, Future[Any]] = {}
        failures: dict[str, BaseException] = {}
        for owner, (func, args) in calls.items():
            try:
                futs[owner] = rpc.rpc_async(owner, func, args=args, timeout=rpc_timeout)
            except Exception as err:  # e.g. the RPC agent is shut down or the name is unknown
                failures[owner] = err
        return self._wait(operation, futs, failures)

    @staticmethod
    def _wait(
        operation: str,
        futs: dict[str, Future[Any]],
        failures: dict[str, BaseException],
    ) -> dict[str, Any]:
        """Wait for every started call; raise one error naming all failures (started or not)."""
        results: dict[str, Any] = {}
        for owner, fut in futs.items():
            try:
                result = fut.wait()
            except Exception as err:
                failures[owner] = err
                continue
            # An `async_execution` reply whose Future failed arrives as the exception object
            # itself (torch 2.13), not as a raised error; no entry point returns an exception.
            if isinstance(result, BaseException):
                failures[owner] = result
            elif isinstance(result, str):  # a failed TorchScript step; see [Note: Step requests]
                failures[owner] = RuntimeError(result)
            else:
                results[owner] = result
        if failures:
            raise RemoteOptimizerError(operation, failures, list(results))
        return results
