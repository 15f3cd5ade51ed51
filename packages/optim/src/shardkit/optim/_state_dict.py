"""State dicts of a ShardedOptimizer: local shard, consolidation, loading, full-precision export.

``_StateDictMixin`` holds the methods; ``ShardedOptimizer`` inherits them (see
``_sharded_optimizer.py`` for the attributes they read).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from shardkit.optim._agreement import (
    CONSOLIDATE_CALL,
    IMPLICIT_CONSOLIDATE_CALL,
    MASTER_STATE_DICT_CALL,
    agree_call,
)
from shardkit.optim._consolidate import _consolidate
from shardkit.optim._driver import ShardLayout, ShardOwner
from shardkit.optim._master import (
    MASTER_KEY,
    _Masters,
    check_master_values,
    split_wire,
)
from shardkit.optim._profiling import profiler_range
from shardkit.optim._state import (
    _hyperparams,
    _install_state,
    _local_load_dict,
    _StateFlag,
    _validate_plain_state_dict,
)
from torch import nn
from torch.optim import Optimizer

__all__: list[str] = []

logger = logging.getLogger("shardkit.optim")
_warned_ignored_masters = False
_logged_implicit = False


class _StateDictMixin:
    """State-dict methods of ``ShardedOptimizer``."""

    # Provided by ShardedOptimizer.
    optim: Optimizer
    param_groups: list[dict[str, Any]]
    state: Any
    group: dist.ProcessGroup
    rank: int
    world_size: int
    master_dtype: torch.dtype | None
    _layout: ShardLayout
    _masters: _Masters | None
    _consolidated: tuple[int, dict[str, Any]] | None
    _last_consolidation: tuple[int, int, bool] | None
    _state_flag: _StateFlag
    _state_version: int
    _timeout: timedelta | None

    def _opt_tensor(self, p: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _owner(self) -> ShardOwner | None:
        raise NotImplementedError

    def _owned_entries(self) -> dict[int, dict[str, Any]]:
        raise NotImplementedError

    def _push_hyperparams(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ shard
    def _global_param_groups(self) -> list[dict[str, Any]]:
        groups = []
        start = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append(
                {**copy.deepcopy(_hyperparams(g)), "params": list(range(start, start + n))}
            )
            start += n
        return groups

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's shard as ``{"state": {global index: state}, "param_groups": ...}`` (live).

        With master weights, also ``"master_params": {global index: master}`` (live). Under a
        ``ShardOwner`` (see [Note: Step drivers]) it is the owner's ``checkpoint_state_dict()``
        (collective there: every rank calls it, as ``save_sharded`` does).
        """
        owner = self._owner()
        if owner is not None:
            return owner.checkpoint_state_dict()
        state, masters = split_wire(self._owned_entries())
        out: dict[str, Any] = {"state": state, "param_groups": self._global_param_groups()}
        if self._masters is not None:
            out[MASTER_KEY] = masters
        return out

    # ------------------------------------------------------------------ consolidation
    def consolidate_state_dict(
        self,
        recipient_rank: int = 0,
        skip: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        """Gathers the full state on ``recipient_rank`` (-1: every rank). Collective.

        See [Note: Tensor consolidation] for what moves where. With master weights the master
        values are gathered too (``"master_params"`` in :meth:`state_dict`).

        Args:
            recipient_rank: rank in the optimizer's group, or -1 for all ranks.
            skip: params for which ``skip(param)`` is true keep their state on their owner; the
                consolidated dict has their entries with ``meta`` tensors of the right shapes
                (save those with :meth:`local_state_dict` on each owner instead).
        """
        # Every rank in this call, within collective_timeout: see [Note: Call agreement].
        agree_call(CONSOLIDATE_CALL, self.group, self._timeout)
        # Bad arguments raise on every rank: the error rides on the metadata exchange, which
        # every rank reaches, so a rank with valid arguments never waits for a crashed one.
        error: Exception | None = None
        if (
            isinstance(recipient_rank, bool)
            or not isinstance(recipient_rank, int)
            or not -1 <= recipient_rank < self.world_size
        ):
            error = ValueError(
                f"recipient_rank must be an int in [-1, {self.world_size}) (a rank of the "
                f"optimizer's group of size {self.world_size}, or -1 for every rank), got "
                f"{type(recipient_rank).__name__}: {recipient_rank!r}"
            )
        elif not (skip is None or callable(cast(object, skip))):
            error = TypeError(
                f"skip must be a callable taking a param and returning True for the params whose "
                f"state is not gathered (e.g. lambda p: p in expert_params), or None; got "
                f"{type(skip).__name__}: {skip!r}"
            )
        skipped = set()
        if skip is not None and error is None:
            try:
                skipped = {i for i in self._layout.owned(self.rank) if skip(self._layout.params[i])}
            except Exception as e:  # raised on every rank below, not only here
                error = e
        # Drop the previous consolidated copy first, so the peak is one copy, not two.
        self._consolidated = None
        owner = self._owner()
        if owner is not None:  # See [Note: Step drivers]: the owner holds the state
            if error is not None:
                raise error
            # The owner assembles the full dict on every rank anyway: every rank keeps it.
            self._consolidated = (self._state_version, owner.full_state_dict())
            self._last_consolidation = (self._state_version, recipient_rank, False)
            return
        local = self._owned_entries()
        with profiler_range("shardkit.optim.consolidate"):  # See [Note: Profiler ranges]
            full = _consolidate(
                local,
                self.group,
                self.rank,
                recipient_rank if error is None else 0,
                skipped,
                error=error,
            )
        self._last_consolidation = (self._state_version, recipient_rank, False)
        if full is None:
            self._consolidated = None
            return
        state, masters = split_wire(full)
        sd: dict[str, Any] = {"state": state, "param_groups": self._global_param_groups()}
        if self._masters is not None:
            sd[MASTER_KEY] = masters
        self._consolidated = (self._state_version, sd)

    # [Note: Implicit consolidation]
    # Two ways to get the full state, told apart by the history of consolidations, which every
    # rank shares (consolidating is collective), so every rank takes the same branch:
    # - explicit (fairscale's and torch's pattern): ``consolidate_state_dict(recipient_rank=r)``
    #   (or ``state_dict(all_ranks=True)``) on every rank, then ``state_dict()`` on rank r alone.
    #   Once the program has consolidated explicitly, ``state_dict()`` never communicates: it
    #   returns the copy while it is current and raises on a rank that has none, or once the
    #   optimizer stepped or loaded since (as before implicit consolidation existed).
    # - implicit (what torch.distributed.checkpoint.state_dict and Accelerate do): every rank
    #   calls ``state_dict()`` and nobody consolidates. When the program never consolidated
    #   explicitly (or its last consolidation was an implicit one, now stale), ``state_dict()``
    #   consolidates onto every rank first: a collective, so every rank must call it. It first
    #   waits for every rank in one all-reduce under ``collective_timeout``, so a rank calling it
    #   alone raises after that timeout instead of hanging. The full state is then held on every
    #   rank until the next step or load (for a checkpoint at the memory of one shard per rank,
    #   use ``save_sharded``). A program that mixes both calls
    #   ``consolidate_state_dict(recipient_rank=-1)`` on every rank before the implicit use.
    def _needs_implicit_consolidation(self) -> bool:
        if self._consolidated is not None and self._consolidated[0] == self._state_version:
            return False
        return self._last_consolidation is None or self._last_consolidation[2]

    def _consolidate_implicitly(self) -> None:
        """Consolidates onto every rank. See [Note: Implicit consolidation]. Collective."""
        global _logged_implicit
        if not _logged_implicit:
            _logged_implicit = True
            logger.info(
                "state_dict() with no consolidate_state_dict() since the last step: consolidating "
                "the full optimizer state onto every rank (a collective: every rank calls "
                "state_dict(), as torch.distributed.checkpoint.state_dict does)"
            )
        agree_call(
            IMPLICIT_CONSOLIDATE_CALL, self.group, self._timeout
        )  # See [Note: Call agreement]
        _StateDictMixin.consolidate_state_dict(self, recipient_rank=-1)
        self._last_consolidation = (self._state_version, -1, True)

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """The consolidated state in plain torch format (loads into ``optim`` unsharded).

        With master weights the dict also has ``"master_params"``: {global index: master
        value} (``master_dtype``, on the CPU), beside the plain ``"state"`` (the state of the
        masters) and ``"param_groups"``; plain torch optimizers ignore the extra key.

        After ``consolidate_state_dict(recipient_rank=r)`` on every rank, call it on rank ``r``
        alone (no communication). In a program that never consolidates explicitly, it is a
        collective that consolidates onto every rank first, so
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` and Accelerate work: see
        [Note: Implicit consolidation].

        Args:
            all_ranks: consolidate on every rank first (collective) and return it everywhere.

        Raises:
            RuntimeError: the state was consolidated onto another rank, or onto this rank and
                the optimizer stepped/loaded since; or, in the implicit collective, some rank
                did not call it within ``collective_timeout``.
        """
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        elif self._needs_implicit_consolidation():
            self._consolidate_implicitly()
        if self._consolidated is None:
            raise RuntimeError(
                f"rank {self.rank}: the optimizer state has not been consolidated on this rank. "
                f"Call optimizer.consolidate_state_dict(recipient_rank={self.rank}) on every "
                f"rank first (or state_dict(all_ranks=True) on every rank; before "
                f"torch.distributed.checkpoint's get_state_dict, "
                f"consolidate_state_dict(recipient_rank=-1) on every rank)."
            )
        version, sd = self._consolidated
        if version != self._state_version:
            raise RuntimeError(
                "the optimizer stepped or loaded state since consolidate_state_dict(): the "
                "consolidated state is stale. Call consolidate_state_dict() again on every rank."
            )
        out: dict[str, Any] = {
            "state": {i: dict(st) for i, st in sd["state"].items()},
            "param_groups": [dict(g, params=list(g["params"])) for g in sd["param_groups"]],
        }
        if MASTER_KEY in sd:
            out[MASTER_KEY] = dict(sd[MASTER_KEY])
        return out

    # ------------------------------------------------------------------ loading
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a plain torch optimizer state dict (from any world size); keeps only this shard.

        The caller's dict is not modified nor aliased. ``meta`` placeholder entries (params
        skipped at consolidation) leave the current state of those params untouched. With
        master weights, each owned master is set from ``"master_params"`` exactly when the dict
        has it, else from the live param (load the model's weights first).
        """
        owner = self._owner()
        if owner is not None:  # See [Note: Step drivers]
            owner.load_full_state_dict(state_dict)
            for wg, sg in zip(self.param_groups, state_dict["param_groups"], strict=True):
                wg.update(copy.deepcopy(_hyperparams(sg)))
            self._state_version += 1
            return
        global _warned_ignored_masters
        _validate_plain_state_dict(state_dict, self.param_groups)
        params = [p for g in self.param_groups for p in g["params"]]
        masters_in: dict[int, torch.Tensor] = {}
        if MASTER_KEY in state_dict:
            masters_in = check_master_values(state_dict[MASTER_KEY], params)
            if self._masters is None and masters_in and not _warned_ignored_masters:
                _warned_ignored_masters = True
                logger.warning(
                    "load_state_dict: the state dict carries %d master weights "
                    "('master_params') but this optimizer has master_dtype=None; they are "
                    "ignored (build the optimizer with master_dtype=torch.float32 to keep them)",
                    len(masters_in),
                )
        current = {
            p: st
            for p in (self._layout.params[i] for i in self._layout.owned(self.rank))
            if (st := self.optim.state.get(self._opt_tensor(p)))
        }
        local = _local_load_dict(
            state_dict, self._layout, self.rank, len(self.param_groups), current
        )
        self.optim.load_state_dict(local)
        self.state = _install_state(self.optim, self._state_flag)
        self._state_flag.value = True
        if self._masters is not None:
            with torch.no_grad():
                for i in self._layout.owned(self.rank):
                    p = self._layout.params[i]
                    m = self._masters.get(p)
                    value = masters_in.get(i)
                    if m is None or (value is not None and value.is_meta):
                        continue  # no master, or skipped at consolidation: keep it
                    m.copy_(p if value is None else value)
        for wg, sg in zip(self.param_groups, state_dict["param_groups"], strict=True):
            wg.update(copy.deepcopy(_hyperparams(sg)))
        self._push_hyperparams()
        self._state_version += 1

    def checkpoint_indices(self) -> list[int]:
        """Global indices (see [Note: Global parameter index]) whose saved state this rank
        reads when ``load_sharded`` loads a sharded checkpoint: the params it owns, or under a
        ``ShardOwner`` the indices the owner names (every param, for ZeRO-2's element ranges:
        see [Note: DCP sharded checkpoints]). Local. Part of :class:`ShardedCheckpointable`."""
        owner = self._owner()
        if owner is not None:
            return owner.checkpoint_indices()
        return self._layout.owned(self.rank)

    # ------------------------------------------------------------------ model weights
    def master_model_state_dict(
        self, model: nn.Module, recipient_rank: int = 0
    ) -> dict[str, torch.Tensor] | None:
        """The model's state dict at full precision, for export. Collective.

        Every param with a master is replaced by its master value, gathered from its owner;
        every other floating tensor is upcast to ``master_dtype`` (exact); the rest is copied.
        Tensors are on the CPU.

        Args:
            model: the model whose params this optimizer steps (names come from it).
            recipient_rank: rank of the optimizer's group that gets the dict, -1 for every rank.

        Returns:
            The state dict on the recipient(s), ``None`` elsewhere.

        Raises:
            RuntimeError: the optimizer has no master weights (``master_dtype=None``).
        """
        masters = self._require_masters("master_model_state_dict")
        agree_call(MASTER_STATE_DICT_CALL, self.group, self._timeout)  # See [Note: Call agreement]
        index = {id(p): i for i, p in enumerate(self._layout.params)}
        local: dict[int, dict[str, Any]] = {}
        for i in self._layout.owned(self.rank):
            m = masters.get(self._layout.params[i])
            if m is not None:
                local[i] = {"master": m}
        full = _consolidate(local, self.group, self.rank, recipient_rank, set())
        if full is None:
            return None
        out: dict[str, torch.Tensor] = {}
        for key, value in model.state_dict(keep_vars=True).items():
            gi = index.get(id(value))
            if gi is not None and gi in full:
                out[key] = full[gi]["master"]
            elif value.is_floating_point():
                out[key] = value.detach().to("cpu", masters.dtype, copy=True)
            else:
                out[key] = value.detach().to("cpu", copy=True)
        return out

    def load_master_model_state_dict(
        self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Loads full-precision weights into the model (cast to its dtypes) and the masters.

        Every rank passes the whole dict (e.g. from :meth:`master_model_state_dict` or an fp32
        checkpoint): the model's params get the values rounded to their dtype, and the masters
        this rank owns get them exactly. Not a collective.

        Args:
            model: the model whose params this optimizer steps.
            state_dict: the full-precision model state dict.
            strict: as for ``nn.Module.load_state_dict``.

        Raises:
            RuntimeError: the optimizer has no master weights, or ``strict`` and keys differ.
        """
        masters = self._require_masters("load_master_model_state_dict")
        model.load_state_dict(state_dict, strict=strict)
        values = dict(state_dict)
        with torch.no_grad():
            for name, p in model.named_parameters(remove_duplicate=False):
                m = masters.get(p)
                if m is not None and name in values:
                    m.copy_(values[name])
        self._state_version += 1

    def _require_masters(self, what: str) -> _Masters:
        if self._masters is None:
            raise RuntimeError(
                f"{what}() needs master weights, and this ShardedOptimizer has "
                f"master_dtype=None; build it with master_dtype=torch.float32 (use the model's "
                f"own state_dict() otherwise)"
            )
        return self._masters
