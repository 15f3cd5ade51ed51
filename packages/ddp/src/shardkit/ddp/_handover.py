"""How ``ShardedDataParallel`` drives each ``ShardedOptimizer`` it wraps.

[Note: Optimizer hand-over]
The training loop keeps calling the ``ShardedOptimizer``'s ``step()``, ``zero_grad()``,
``clip_grad_norm()`` and ``state_dict()``, but once wrapped its params' gradients live in the
wrapper's grad shards, not in ``.grad``. So at construction the wrapper takes each optimizer
over (one :class:`_Unit` per optimizer: its buckets and its local stepper):

- it attaches as the optimizer's external stepper (shardkit-optim's [Note: External stepper])
  and registers a step pre-hook (public ``register_step_pre_hook``) that waits for the
  reductions, steps that optimizer's local shards, all-gathers its params and marks the step
  taken; the optimizer's own ``step()`` then only runs its per-step agreement
  (hyper-parameters equal on every rank) and consumes the mark;
- ``zero_grad``, ``clip_grad_norm``, ``consolidate_state_dict``, ``state_dict`` and
  ``load_state_dict`` are replaced *on that instance* by versions scoped to that optimizer's
  buckets, and ``add_param_group`` / ``refresh_trainable`` / ``set_partition`` raise (the
  bucket layout is fixed at construction); ``local_state_dict`` (then collective) and the
  layout's ``owned`` are replaced so that shardkit-optim's ``save_sharded`` / ``load_sharded``
  work exactly (see [Note: DCP sharded checkpoints] in ``shardkit.ddp._state_dict``);
- ``ShardedGradScaler``'s hooks (``_unscale_for_scaler``, ``_drop_grad_factors``, see
  shardkit-optim's [Note: Master weights]) are replaced too, so the scaler checks and unscales
  the reduced grad shards (``_Stepper.unscale``) and its found-inf, agreed over the group,
  skips the step on every rank;
- the optimizer's own master copies (``master_dtype``) are released: the masters live with the
  shards here.

With several optimizers (fairscale's ``ShardedDataParallel(model, [opt1, opt2])``) every
backward reduces the gradients of all of them; ``opt_k.step()`` steps and gathers only
``opt_k``'s buckets and consumes only their gradients, so gradients of an optimizer that did
not step yet accumulate over the next backward, as ``.grad`` does with DDP.

``close()`` undoes none of it (the params stay views of the flat buffers); the optimizers are
meant to be used through the wrapper from then on.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from shardkit.ddp._layout import _Bucket
from shardkit.ddp._state_dict import _ElementRangeLayout, checkpoint_shard
from shardkit.ddp._stepper import _Stepper
from shardkit.optim import ShardedOptimizer

if TYPE_CHECKING:
    from shardkit.ddp._sharded_ddp import ShardedDataParallel

__all__: list[str] = []

STEPPER_NAME = "shardkit.ddp.ShardedDataParallel"


@dataclass(eq=False)
class _Unit:
    """One wrapped ``ShardedOptimizer``: its buckets, its local stepper and its state."""

    index: int
    """Position of the optimizer in the wrapper's ``sharded_optimizers``."""
    opt: ShardedOptimizer
    buckets: list[_Bucket]
    stepper: _Stepper
    trainable: list[bool]
    """``requires_grad`` of each of the optimizer's params at construction."""
    consolidated: dict[str, Any] | None = None
    """The state dict ``consolidate_state_dict()`` built, until ``state_dict()`` takes it."""

    def params(self) -> list[torch.Tensor]:
        """The optimizer's params, in its global order."""
        return [p for g in self.opt.param_groups for p in g["params"]]


def take_over(ddp: ShardedDataParallel, unit: _Unit) -> None:
    """See [Note: Optimizer hand-over]."""
    opt = unit.opt
    opt._attach_stepper(STEPPER_NAME)
    ddp._pre_hooks.append(
        opt.register_step_pre_hook(lambda o, args, kwargs: ddp._pre_step(unit, o, args, kwargs))
    )
    if getattr(opt, "_masters", None) is not None:
        opt._masters = None  # the masters live with the shards here

    def zero_grad(self: ShardedOptimizer, set_to_none: bool = True) -> None:
        ddp._zero_grad_units([unit], set_to_none)

    def clip_grad_norm(
        self: ShardedOptimizer,
        max_norm: float,
        norm_type: float = 2.0,
        filter_params_fn: Callable[[Any], Any] | None = None,
    ) -> torch.Tensor:
        if filter_params_fn is not None:
            raise ValueError(
                "clip_grad_norm(filter_params_fn=...) is not supported under "
                "ShardedDataParallel: gradients are sharded by element ranges, not params"
            )
        return ddp._clip_units([unit], max_norm, norm_type)

    def consolidate_state_dict(self: ShardedOptimizer, recipient_rank: int = 0) -> None:
        unit.consolidated = ddp.optimizer_state_dict(unit.index)

    def state_dict(self: ShardedOptimizer, all_ranks: bool = False) -> dict[str, Any]:
        if all_ranks:
            return ddp.optimizer_state_dict(unit.index)
        if unit.consolidated is None:
            raise RuntimeError(
                "ShardedOptimizer.state_dict() under ShardedDataParallel: call "
                "optimizer.consolidate_state_dict() on every rank first (or "
                "state_dict(all_ranks=True), or ddp.optimizer_state_dict(), on every rank)"
            )
        out, unit.consolidated = unit.consolidated, None
        return out

    def load_state_dict(self: ShardedOptimizer, sd: dict[str, Any]) -> None:
        ddp.load_optimizer_state_dict(sd, unit.index)

    def unscale_for_scaler(
        self: ShardedOptimizer, inv_scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        ddp._reducer.finish_all()
        return unit.stepper.unscale(unit.buckets, inv_scale)

    def drop_grad_factors(self: ShardedOptimizer) -> None:
        unit.stepper.factors.clear()

    def local_state_dict(self: ShardedOptimizer) -> dict[str, Any]:
        full = ddp.optimizer_state_dict(unit.index)
        return checkpoint_shard(full, ddp.rank, ddp.world_size)

    def frozen_layout(self: ShardedOptimizer, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "ShardedDataParallel fixed this optimizer's params and bucket layout at "
            "construction: build a new ShardedOptimizer and ShardedDataParallel instead"
        )

    for name, fn in (
        ("zero_grad", zero_grad),
        ("clip_grad_norm", clip_grad_norm),
        ("consolidate_state_dict", consolidate_state_dict),
        ("state_dict", state_dict),
        ("load_state_dict", load_state_dict),
        ("_unscale_for_scaler", unscale_for_scaler),
        ("_drop_grad_factors", drop_grad_factors),
        ("local_state_dict", local_state_dict),
        ("add_param_group", frozen_layout),
        ("refresh_trainable", frozen_layout),
        ("set_partition", frozen_layout),
    ):
        setattr(opt, name, types.MethodType(fn, opt))
    # every param "owned" on every rank: see [Note: DCP sharded checkpoints]
    cast(Any, opt)._layout = _ElementRangeLayout(opt._layout)
