"""A ``torch.optim.Optimizer`` facade over a DistributedOptimizer's ``param_groups``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ParamGroupsView"]

# Passed by DistributedOptimizer.step to ParamGroupsView.step; anything else is a user mistake.
_DRIVER_TOKEN = object()


# [Note: Scheduler view]
# torch's LR schedulers insist on `isinstance(optimizer, torch.optim.Optimizer)`, read and write
# `optimizer.param_groups[i][key]`, and wrap `optimizer.step` to detect "scheduler.step() before
# optimizer.step()". The view is a real Optimizer whose `param_groups` *is* the
# DistributedOptimizer's list of group dicts (same objects), so any scheduler edit lands there and
# is forwarded to every owner with the next step (see [Note: Hyper-parameter forwarding]). After
# each successful distributed step, the DistributedOptimizer calls `view.step(_DRIVER_TOKEN)`, so
# a scheduler's step wrapper sees the step exactly as it would with a local optimizer.


class ParamGroupsView(torch.optim.Optimizer):
    """What to hand to ``torch.optim.lr_scheduler`` classes; get it from
    :attr:`DistributedOptimizer.scheduler_view`.

    It holds no parameters or state. ``param_groups`` is shared with the DistributedOptimizer;
    calling :meth:`step` yourself is an error (call ``DistributedOptimizer.step(context_id)``).
    """

    def __init__(self, param_groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        # Optimizer.__init__ needs one tensor to build its bookkeeping; it is dropped right away.
        super().__init__([torch.empty(0, requires_grad=True)], dict(defaults))
        self.param_groups = param_groups

    def step(self, closure: Callable[[], float] | object | None = None) -> None:  # type: ignore[override]
        """Record that the DistributedOptimizer stepped (called by it, not by users).

        Raises:
            RuntimeError: when called directly; a view cannot step without a context id.
        """
        if closure is not _DRIVER_TOKEN:
            raise RuntimeError(
                "ParamGroupsView.step() cannot run an optimizer step: it has no gradients. Call "
                "DistributedOptimizer.step(context_id) inside the distributed autograd context "
                "instead; it notifies this view (and schedulers attached to it) itself."
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: gradients live in distributed autograd contexts, not on ``.grad``."""
