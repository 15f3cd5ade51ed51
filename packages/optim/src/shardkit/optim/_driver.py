"""The public contract between ``ShardedOptimizer`` and the code that drives its step.

[Note: Step drivers]
A ``ShardedOptimizer`` owns the partition of the params (:class:`ShardLayout`), the per-step
agreement between ranks and the front end a training loop calls (``step``, ``zero_grad``,
``clip_grad_norm``, state dicts). Who *runs* the update is pluggable, through exactly one
attached :class:`StepDriver` at a time (``ShardedOptimizer.attach_driver``):

- no driver (ZeRO-1 under DDP): ``step()`` agrees, steps this rank's shard with the wrapped
  optimizer (``step_local``) and broadcasts the owners' params (``sync_params``);
- a :class:`StepDriver` (shardkit-overlap's DDP comm hook): the driver steps the shard itself,
  bucket by bucket inside backward, through the public ``step_local`` / ``sync_params``;
  ``optimizer.step()`` calls ``driver.step(closure)``, which checks that a synchronised
  backward stepped the shard since the last call and runs the per-step agreement
  (``check_step``);
- a :class:`ShardOwner` (shardkit-ddp's ``ShardedDataParallel``, ZeRO-2): the driver holds the
  sharded state itself (its own flat buffers, grad shards, optimizer state and masters), so at
  attach time the optimizer releases everything it allocated (its flat sync buffers, the
  wrapped optimizer's state, its master copies) and from then on forwards ``step``,
  ``zero_grad``, ``clip_grad_norm``, the state dicts and the loss scaler's unscale to the
  driver. What only ZeRO-1's own backend does does not exist while a ``ShardOwner`` is
  attached ([Note: Members of one mode]).

The optimizer itself is a front: whatever holds the state is a ``ShardOwner`` and every call
above goes to it without a branch. Its own one, ``LocalShards`` (``shardkit.optim._zero1``:
the wrapped optimizer on the whole params this rank owns, their masters and the flat sync
buffers), is built at its first use after each partition and never once an attached
``ShardOwner`` holds the state; the front keeps what is the same for every backend: the
partition, the agreements, the hyper-parameters ([Note: One owner of hyper-parameters] in
``shardkit.optim._state``) and the history of consolidations.

[Note: Members of one mode]
What only whole-param ZeRO-1 can do (``optim``, ``step_local``, ``sync_params``,
``add_param_group``, ``set_partition``, ``refresh_trainable``, ``load_master_model_state_dict``)
does not exist while another owner holds the state: those members are :func:`zero1_only`
descriptors, so reading one raises ``AttributeError`` (``hasattr`` is ``False``) with a message
that names the owner and what to call instead, on every rank alike (the mode is the same on
every rank). Everything else works in both modes.

Every method of a driver that communicates is called on every rank of the optimizer's group
(the optimizer's own methods are collective in the same places), and a driver's ``step`` must
run ``optimizer.check_step(...)`` before it changes any shard, so that a step refused on one
rank (a different learning rate, a missing backward) leaves params and state unchanged on
every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

__all__ = ["ShardLayout", "ShardOwner", "StepDriver"]

_F = TypeVar("_F")


class _Zero1Only:
    """A member of ``ShardedOptimizer`` that exists only while no :class:`ShardOwner` holds its
    state. See [Note: Members of one mode]."""

    def __init__(self, member: Any, instead: str) -> None:
        self.member = member
        self.instead = instead
        self.name = getattr(member, "__name__", "")
        self.__doc__ = getattr(member, "__doc__", None)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        require_zero1(obj, self.name, self.instead)
        return self.member.__get__(obj, objtype)


def require_zero1(obj: Any, name: str, instead: str) -> None:
    """Raises the ``AttributeError`` of [Note: Members of one mode] if a :class:`ShardOwner`
    holds ``obj``'s state (``obj._owner``)."""
    holder = obj.__dict__.get("_owner")
    if holder is not None:
        raise AttributeError(
            f"ShardedOptimizer has no {name!r} while {holder.name} holds its sharded state "
            f"(ZeRO-1 only); {instead}"
        )


def zero1_only(instead: str) -> Callable[[_F], _F]:
    """Makes a method or property of ``ShardedOptimizer`` exist only without a
    :class:`ShardOwner`; ``instead`` ends the ``AttributeError``'s message (what to call). See
    [Note: Members of one mode]."""

    def wrap(member: _F) -> _F:
        return cast(_F, _Zero1Only(member, instead))

    return wrap


@dataclass(frozen=True)
class ShardLayout:
    """Which rank owns which parameter of a ``ShardedOptimizer`` (the ZeRO-1 partition).

    See [Note: Global parameter index] in ``shardkit.optim._state``: a parameter's *global
    index* is its position in the optimizer's param groups flattened in order, as
    ``torch.optim.Optimizer.state_dict`` numbers them.
    """

    params: tuple[torch.Tensor, ...]
    """Every parameter of the optimizer, in global-index order."""
    group_index: tuple[int, ...]
    """Global index -> index of its param group."""
    owner: tuple[int, ...]
    """Global index -> owning rank (rank in the optimizer's process group)."""
    trainable: tuple[bool, ...]
    """Global index -> ``requires_grad`` when the layout was built."""
    order: tuple[int, ...] = ()
    """Global indices in the order params are laid out in the flat sync buffers (empty:
    global-index order). See [Note: Imposed partition]."""

    def owned(self, rank: int) -> list[int]:
        """Global indices owned by ``rank``, ascending."""
        return [i for i, r in enumerate(self.owner) if r == rank]

    def index_of(self) -> dict[int, int]:
        """``id(param) -> global index``."""
        return {id(p): i for i, p in enumerate(self.params)}


class StepDriver(ABC):
    """Runs the step of a ``ShardedOptimizer`` on its behalf. See [Note: Step drivers]."""

    name: str = "a step driver"
    """Shown in error messages (e.g. ``"shardkit.overlap hook"``)."""

    @abstractmethod
    def step(self, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        """What ``optimizer.step(closure, **kwargs)`` does while this driver is attached.

        Must call ``optimizer.check_step(error)`` on every rank before changing any shard.
        Returns what ``step`` returns (the closure's loss, or ``None``).
        """


class ShardOwner(StepDriver):
    """A driver that holds the sharded state itself (ZeRO-2). See [Note: Step drivers].

    While attached, the optimizer forwards these calls here. Every method documented as
    collective is called on every rank of the optimizer's group.
    """

    @abstractmethod
    def zero_grad(self, set_to_none: bool) -> None:
        """Drops the gradients of the optimizer's params (local; ``optimizer.zero_grad``)."""

    @abstractmethod
    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float,
        filter_params_fn: Callable[[Any], Any] | None = None,
    ) -> torch.Tensor:
        """Clips the gradients by their global norm; returns the norm (fp32). Collective.

        ``filter_params_fn`` is ``ShardedOptimizer.clip_grad_norm``'s (an owner that cannot
        honour it raises ``ValueError``)."""

    def shard_state(self) -> Mapping[torch.Tensor, dict[str, Any]]:
        """This rank's optimizer state, by param: for each param with a piece here, the live
        state of that piece (its tensors are what the next step updates: 1-D for a piece of an
        element-range bucket; compact moments as stored). What ``ShardedOptimizer.state``
        shows while this owner is attached ([Note: Optimizer state under ZeRO-2] in
        ``shardkit.optim._state``). The default: none."""
        return {}

    @abstractmethod
    def full_state_dict(
        self, recipient_rank: int = -1, skip: Set[int] = frozenset()
    ) -> dict[str, Any] | None:
        """The full optimizer state dict in plain torch format (``{"state", "param_groups"}``,
        plus ``"master_params"`` with masters). Collective.

        Args:
            recipient_rank: The rank (of the optimizer's group) that needs it, -1 for every
                rank; an owner may return it on more ranks.
            skip: Global indices whose state stays on its owner (``meta`` tensors in the dict;
                an owner that cannot honour it raises ``ValueError``). Every rank passes the
                same.

        Returns:
            The dict, or ``None`` on a rank that does not receive it.
        """

    @abstractmethod
    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a full state dict (plain torch format) into this rank's shards (local)."""

    @abstractmethod
    def checkpoint_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state for a sharded checkpoint: ``{"state": {global index:
        state}, "param_groups": ...}`` (plus ``"master_params"``); every global index appears
        on exactly one rank. Collective (``save_sharded`` calls it on every rank)."""

    @abstractmethod
    def checkpoint_indices(self) -> list[int]:
        """Global indices whose saved state this rank reads when loading a sharded checkpoint
        (then handed to :meth:`load_full_state_dict`)."""

    @abstractmethod
    def unscale_for_scaler(
        self, inv_scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor] | None:
        """``ShardedGradScaler``'s unscale: multiply the reduced gradients by ``inv_scale``
        (or queue it for fp32 masters) and return one found-inf flag per device (local);
        ``None`` leaves it to torch's own unscale of the params' ``.grad``."""

    @abstractmethod
    def drop_grad_factors(self) -> None:
        """Forgets pending unscale / clip factors (the step was skipped; new gradients)."""
