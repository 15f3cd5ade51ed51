"""Gradient clipping by the global norm of a sharded model's gradients."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from shardkit.optim._dist import _comm_device

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
) -> torch.Tensor:
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if not max_norm >= 0 or math.isnan(max_norm):
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm!r}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")
    device = _comm_device(group)
    grads = [p.grad for p in owned if p.grad is not None]
    if grads:
        per = torch.stack(
            [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device) for g in grads]
        )
        local = per.max() if math.isinf(norm_type) else per.pow(norm_type).sum()
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local.pow(1.0 / norm_type)
    clip_coef = max_norm / (total + 1e-6)
    coef = torch.clamp(clip_coef, max=1.0)
    local_grads = [p.grad for p in params if p.grad is not None]
    for g in local_grads:
        g.detach().mul_(coef.to(device=g.device, dtype=g.dtype))
    return total
