"""How ``ShardedDataParallel`` drives each ``ShardedOptimizer`` it wraps.

[Note: Optimizer hand-over]
The training loop keeps calling the ``ShardedOptimizer``'s ``step()``, ``zero_grad()``,
``clip_grad_norm()`` and state-dict methods, but once wrapped its params' gradients live in
the wrapper's grad shards, not in ``.grad``, and its params in the wrapper's flat buffers. So
at construction the wrapper attaches one :class:`_Unit` per optimizer as that optimizer's
``ShardOwner`` (shardkit-optim's public [Note: Step drivers]): the optimizer releases what it
had allocated for its own step (its flat sync buffers, inner optimizer state, master copies)
and forwards ``step``, ``zero_grad``, ``clip_grad_norm``, the state dicts, sharded checkpoints
and ``ShardedGradScaler``'s unscale to the unit, which runs them over that optimizer's buckets
through the wrapper (:class:`_Host`: the wrapper's own methods, handed in). ``add_param_group`` / ``refresh_trainable`` /
``set_partition`` raise (the bucket layout is fixed at construction).

``optimizer.step()`` then runs, in order: the closure (if any), the optimizer's per-step
agreement (hyper-parameters equal on every rank, ``check_step``) and the wrapper's
``requires_grad`` agreement, *before* any shard moves; then the wait for the reductions, the
local step of the shards and the param all-gather.

With several optimizers (fairscale's ``ShardedDataParallel(model, [opt1, opt2])``) every
backward reduces the gradients of all of them; ``opt_k.step()`` steps and gathers only
``opt_k``'s buckets and consumes only their gradients, so gradients of an optimizer that did
not step yet accumulate over the next backward, as ``.grad`` does with DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from shardkit.ddp._layout import _Bucket
from shardkit.optim import ParkedState, ShardedOptimizer, ShardOwner, ShardStepper, checkpoint_part

__all__: list[str] = []

NAME = "shardkit.ddp.ShardedDataParallel"


@dataclass(frozen=True)
class _Host:
    """What a unit needs from the wrapper: ``ShardedDataParallel`` hands its own methods in."""

    rank: int
    world_size: int
    step_unit: Callable[[_Unit, Callable[[], Any] | None], Any]
    """Runs one unit's step (agreement, wait, local step, all-gather)."""
    zero_grad_units: Callable[[Sequence[_Unit], bool], None]
    clip_units: Callable[[Sequence[_Unit], float, float], torch.Tensor]
    finish_reductions: Callable[[], None]
    optimizer_state_dict: Callable[[int], dict[str, Any]]
    """The full state dict of the optimizer with the given index (collective)."""
    load_optimizer_state_dict: Callable[[dict[str, Any], int], None]


class _Unit(ShardOwner):
    """One wrapped ``ShardedOptimizer``: its buckets, its local stepper, and its driver."""

    name = NAME

    def __init__(
        self,
        host: _Host,
        index: int,
        opt: ShardedOptimizer,
        buckets: list[_Bucket],
        stepper: ShardStepper,
    ) -> None:
        self.host = host
        self.index = index
        """Position of the optimizer in the wrapper's ``sharded_optimizers``."""
        self.opt = opt
        self.buckets = buckets
        self.stepper = stepper
        self.trainable = [p.requires_grad for p in self.params()]
        """``requires_grad`` of each of the optimizer's params when the layout was built."""
        self.parked = ParkedState({}, {})
        """Optimizer state of the params outside the layout (see [Note: Trainable refresh])."""

    def rebuild(self, buckets: list[_Bucket], stepper: ShardStepper) -> None:
        """Takes the buckets and stepper of a rebuilt layout (``refresh_trainable``)."""
        self.buckets = buckets
        self.stepper = stepper
        self.trainable = [p.requires_grad for p in self.params()]

    def params(self) -> list[torch.Tensor]:
        """The optimizer's params, in its global order."""
        return [p for g in self.opt.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ ShardOwner
    def step(self, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"ShardedOptimizer.step() under ShardedDataParallel takes no extra arguments "
                f"(the local step runs the wrapped optimizer class on the shards), got "
                f"{sorted(kwargs)}"
            )
        return self.host.step_unit(self, closure)

    def zero_grad(self, set_to_none: bool) -> None:
        self.host.zero_grad_units([self], set_to_none)

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        return self.host.clip_units([self], max_norm, norm_type)

    def full_state_dict(self) -> dict[str, Any]:
        return self.host.optimizer_state_dict(self.index)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.host.load_optimizer_state_dict(state_dict, self.index)

    # See [Note: DCP sharded checkpoints] in ``shardkit.optim._shard_state``.
    def checkpoint_state_dict(self) -> dict[str, Any]:
        full = self.host.optimizer_state_dict(self.index)
        return checkpoint_part(full, self.host.rank, self.host.world_size)

    def checkpoint_indices(self) -> list[int]:
        return list(range(len(self.params())))

    def unscale_for_scaler(self, inv_scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        self.host.finish_reductions()
        return self.stepper.unscale(self.buckets, inv_scale)

    def drop_grad_factors(self) -> None:
        self.stepper.factors.clear()
