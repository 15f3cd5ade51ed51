"""Gradient clipping by the global norm of a sharded model's gradients."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from shardkit.optim._agreement import agree_clip
from shardkit.optim._dist import _comm_device, _reduces_on
from shardkit.optim._master import _Masters

__all__: list[str] = []


# [Note: Sharded grad norm]
# Every param is owned by exactly one rank, so the global p-norm is
# (sum over ranks of sum over owned grads of |g|^p)^(1/p): each rank reduces its owned grads in
# fp32, the p-th powers are all-reduced (SUM) over the optimizer's group, and for p = inf the
# maxima are all-reduced with MAX. The clip coefficient is then applied to every local grad, as
# torch.nn.utils.clip_grad_norm_ does on an unsharded model.


def _clip_grad_norm(
    owned: list[torch.Tensor],
    params: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup,
    masters: _Masters | None = None,
) -> torch.Tensor:
    """See [Note: Sharded grad norm]; with ``masters``, [Note: Master weights]."""
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if not max_norm >= 0 or math.isnan(max_norm):
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm!r}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")
    grads = [p.grad for p in owned if p.grad is not None]
    # The norm lives where the grads do (as with torch.nn.utils.clip_grad_norm_); only a
    # backend that cannot reduce there (NCCL with host grads) gets a copy on its own device.
    device = grads[0].device if grads else params[0].device if params else _comm_device(group)
    if grads:
        per = torch.stack(
            [_norm(p, norm_type, masters).to(device) for p in owned if p.grad is not None]
        )
        local = per.max() if math.isinf(norm_type) else per.pow(norm_type).sum()
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    wire = local if _reduces_on(group, device) else local.to(_comm_device(group))
    total = agree_clip(wire, max_norm, norm_type, group).to(device)  # [Note: Per-step agreement]
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    clip_coef = max_norm / (total + 1e-6)
    coef = torch.clamp(clip_coef, max=1.0)
    if masters is not None:
        masters.add_factor(coef)  # applied to the fp32 grads at the step
    local_grads = [
        p.grad for p in params if p.grad is not None and (masters is None or not masters.covers(p))
    ]
    for g in local_grads:
        g.detach().mul_(coef.to(device=g.device, dtype=g.dtype))
    return total


def _norm(p: torch.Tensor, norm_type: float, masters: _Masters | None) -> torch.Tensor:
    """fp32 norm of ``p``'s gradient; with a master, of its upcast gradient times the pending
    factors (computed on one param's fp32 temporary, as the step will see it)."""
    g = p.grad
    assert g is not None  # filtered by the caller
    if masters is None or masters.get(p) is None:
        g32 = g.detach()
    else:
        g32 = g.detach().to(masters.dtype)
        for factor in masters.factors:
            g32.mul_(factor.to(device=g32.device, dtype=g32.dtype))
    norm: torch.Tensor = torch.linalg.vector_norm(g32, norm_type, dtype=torch.float32)
    return norm
