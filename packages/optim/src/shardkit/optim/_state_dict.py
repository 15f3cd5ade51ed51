"""The history of a ShardedOptimizer's consolidations: which full state dict is current where.

``ShardedOptimizer.consolidate_state_dict`` / ``state_dict`` read and write one
:class:`Consolidations`; the backend (``LocalShards`` or a ``ShardOwner``) assembles the dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from shardkit.optim._master import MASTER_KEY

__all__ = ["Consolidations", "check_consolidate_args"]


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
class Consolidations:
    """The last consolidated state dict and how it was asked for. See [Note: Implicit
    consolidation]. Every method is local."""

    def __init__(self) -> None:
        self.copy: tuple[int, dict[str, Any]] | None = None
        """(state version, full state dict) held on this rank, if any."""
        self.last: tuple[int, int, bool] | None = None
        """(state version, recipient rank, implicit) of the last consolidation."""

    def drop(self) -> None:
        """Forgets the held copy (before a new one is made: the peak is one copy, not two)."""
        self.copy = None

    def record(
        self, version: int, recipient: int, implicit: bool, state_dict: dict[str, Any] | None
    ) -> None:
        """Records a consolidation and the dict it left on this rank (``None``: not here)."""
        self.copy = None if state_dict is None else (version, state_dict)
        self.last = (version, recipient, implicit)

    def mark_implicit(self) -> None:
        """Marks the last consolidation (onto every rank) as an implicit one."""
        if self.last is not None:
            self.last = (self.last[0], self.last[1], True)

    def needs_implicit(self, version: int) -> bool:
        """Whether ``state_dict()`` must consolidate onto every rank first."""
        if self.copy is not None and self.copy[0] == version:
            return False
        return self.last is None or self.last[2]

    def current(self, version: int, rank: int) -> dict[str, Any]:
        """A fresh copy of the held dict (top-level containers copied, tensors shared).

        Raises:
            RuntimeError: nothing was consolidated onto this rank, or it is stale.
        """
        if self.copy is None:
            raise RuntimeError(
                f"rank {rank}: the optimizer state has not been consolidated on this rank. "
                f"Call optimizer.consolidate_state_dict(recipient_rank={rank}) on every "
                f"rank first (or state_dict(all_ranks=True) on every rank; before "
                f"torch.distributed.checkpoint's get_state_dict, "
                f"consolidate_state_dict(recipient_rank=-1) on every rank)."
            )
        held, sd = self.copy
        if held != version:
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


def check_consolidate_args(
    recipient_rank: object,
    skip: object,
    params: Sequence[torch.Tensor],
    world_size: int,
) -> tuple[set[int], Exception | None]:
    """``consolidate_state_dict``'s arguments on this rank: (the global indices ``skip``
    selects, this rank's error). The error is returned, not raised: every rank raises the
    first failing rank's (``agree_outcome``) before any tensor moves."""
    if (
        isinstance(recipient_rank, bool)
        or not isinstance(recipient_rank, int)
        or not -1 <= recipient_rank < world_size
    ):
        return set(), ValueError(
            f"recipient_rank must be an int in [-1, {world_size}) (a rank of the optimizer's "
            f"group of size {world_size}, or -1 for every rank), got "
            f"{type(recipient_rank).__name__}: {recipient_rank!r}"
        )
    if skip is None:
        return set(), None
    if not callable(skip):
        return set(), TypeError(
            f"skip must be a callable taking a param and returning True for the params whose "
            f"state is not gathered (e.g. lambda p: p in expert_params), or None; got "
            f"{type(skip).__name__}: {skip!r}"
        )
    predicate = cast(Callable[[torch.Tensor], bool], skip)
    try:
        return {i for i, p in enumerate(params) if predicate(p)}, None
    except Exception as e:  # raised on every rank by the caller, not only here
        return set(), e
