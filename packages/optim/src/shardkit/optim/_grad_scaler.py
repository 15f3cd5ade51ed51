"""An AMP gradient scaler whose skip/step decision is agreed on by every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._dist import _comm_device, _resolve_group
from torch.optim import Optimizer

__all__ = ["ShardedGradScaler"]


# [Note: Agreed found-inf]
# With ZeRO-1 each rank steps only its own shard, but an inf/nan found in any gradient must make
# *every* rank skip, or the params diverge. ``unscale_`` therefore folds this rank's per-device
# found-inf flags into one flag, all-reduces it with MAX over the group and writes the result back
# into every per-device flag (adding one if this rank saw no gradients at all), so ``step`` and
# ``update`` take the same decision on every rank.


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a :class:`ShardedOptimizer` (or any data-parallel setup).

    With a ShardedOptimizer that keeps master weights (``master_dtype``), the fp16 model's
    gradients are only checked for inf/nan; ``1/scale`` is applied to the fp32 master
    gradients at the step, so small gradients do not underflow in fp16.

    Args:
        device: ``"cuda"`` or ``"cpu"`` (CPU autocast with fp16/bf16).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for
            ``torch.amp.GradScaler``.
        group: the group over which the found-inf decision is reduced (default: the default
            group; use the optimizer's ``group``).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.group = _resolve_group(group)

    def _unscale_grads_(
        self,
        optimizer: Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's per-optimizer unscale step (called by ``unscale_``), overridden so that a
        ShardedOptimizer with master weights unscales its fp32 gradients instead of the
        model's fp16 ones (see [Note: Master weights]; this override of a torch internal is
        listed and pinned in ``_torch_compat``)."""
        unscale = getattr(optimizer, "_unscale_for_scaler", None)
        found: dict[torch.device, torch.Tensor] | None = (
            unscale(inv_scale) if unscale is not None else None
        )
        if found is None:
            found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return found

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """``GradScaler.step``; a skipped step also drops the ``1/scale`` queued for master
        weights, so it cannot apply to the next step's gradients (whoever zeroes them)."""
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            drop = getattr(optimizer, "_drop_grad_factors", None)
            if drop is not None:
                drop()

    def unscale_(self, optimizer: Optimizer) -> None:
        """Unscales this rank's gradients and agrees on found-inf with every rank. Collective."""
        if not self._enabled:
            return
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        found = state["found_inf_per_device"]
        device = _comm_device(self.group)
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for v in found.values():
            flag = torch.maximum(flag, v.to(device=device, dtype=torch.float32).reshape(()))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not found:
            found[device] = flag.clone()
        for dev, v in found.items():
            v.copy_(flag.to(device=dev, dtype=v.dtype).reshape(v.shape))
