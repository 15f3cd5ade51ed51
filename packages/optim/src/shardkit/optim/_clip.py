"""Gradient clipping by the global norm of sharded gradients: the one implementation of ZeRO-1
(``ShardedOptimizer.clip_grad_norm``, shardkit-overlap's loop step) and ZeRO-2
(shardkit-ddp's ``ShardedDataParallel.clip_grad_norm_``).

[Note: Sharded grad norm]
The global p-norm of gradients spread over the ranks, as accurate as an fp64 reference (rtol
1e-6, tested at world 2 and 3 with params of millions of elements) and decided alike on every
rank:

1. *fp32 per piece, in blocks.* Every rank reduces its gradient pieces (ZeRO-1: each param it
   owns; ZeRO-2: its live reduced grad shards, whose padding is zero) to fp32 norms of
   ``BLOCK``-element rows (:func:`block_norms`: one ``vector_norm(..., dim=1)`` kernel per
   piece), never one fp32 norm over a long tensor: torch's CPU kernel accumulates a long
   reduction in fp32 lanes (1e-5 relative error at 1M elements, 7e-4 at 16M, torch 2.13), and
   one norm over a long flat shard was 3.9e-5 off in a GPT run. A 4096-element row keeps every
   fp32 accumulation short on any backend.
2. *fp64 combine.* :func:`grad_norm_partial` sums the p-th powers of those fp32 norms in fp64
   (their max for ``inf``): this rank's partial.
3. *One all-gather of one row per rank.* :func:`agree_grad_norm` gathers ``[partial, max_norm,
   norm_type, *flags]`` (fp64) from every rank: over the optimizer's group (ZeRO-1), or
   through the driver's counting all-gather (ZeRO-2: shardkit-ddp's ``comm_stats`` count it).
4. *Agreement on every rank.* Every rank reads the same rows, so every rank takes the same
   decision: different ``(max_norm, norm_type)`` raise ``ValueError`` on every rank naming each
   rank's values (each rank would otherwise clip with its own), invalid values raise alike, and
   the caller's per-rank flags (shardkit-ddp: gradients to clip, already clipped) come back
   per rank for its own check. No rank decides alone before the collective, so none waits
   in it for a rank that raised.
5. *Total and coefficient.* The partials are summed in fp64 in rank order (max for ``inf``):
   the same bits on every rank; ``total = sum ** (1/p)`` rounded to fp32, and torch's
   coefficient ``clamp(max_norm / (total + 1e-6), max=1)`` in fp32. Gradients without a master
   are multiplied in place; those stepped through a master get it queued as a factor (see
   [Note: Master weights]), as torch.nn.utils.clip_grad_norm_ does on an unsharded model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from shardkit.optim._dist import AllGather, _comm_device, _reduces_on
from shardkit.optim._master_set import MasterSet
from shardkit.optim._torch_compat import all_gather_single

__all__ = [
    "BLOCK",
    "GradNorm",
    "agree_grad_norm",
    "block_norms",
    "check_clip_args",
    "grad_norm_partial",
]

BLOCK = 4096
"""Elements per fp32 partial norm (see [Note: Sharded grad norm])."""


def check_clip_args(max_norm: object, norm_type: object) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats; their values are checked by :func:`agree_grad_norm`
    on every rank.

    Raises:
        TypeError: one is not a real number (or a one-element tensor).
    """
    out = []
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        ok = isinstance(value, numbers.Real) or (
            isinstance(value, torch.Tensor) and value.numel() == 1
        )
        if not ok or isinstance(value, bool):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
        out.append(float(value))  # type: ignore[arg-type]
    return out[0], out[1]


def block_norms(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """fp32 ``norm_type`` norms of ``grad``'s consecutive :data:`BLOCK`-element rows (flat
    order; the last row may be shorter): one 1-D fp32 tensor, empty for an empty ``grad``.
    See [Note: Sharded grad norm]."""
    flat = grad.detach().reshape(-1)
    n = flat.numel()
    full = n - n % BLOCK
    parts = []
    if full:
        rows = flat[:full].view(-1, BLOCK)
        parts.append(torch.linalg.vector_norm(rows, norm_type, dim=1, dtype=torch.float32))
    if n > full:
        tail = torch.linalg.vector_norm(flat[full:], norm_type, dtype=torch.float32)
        parts.append(tail.reshape(1))
    if not parts:
        return torch.zeros(0, dtype=torch.float32, device=grad.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def grad_norm_partial(
    norms: Sequence[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """This rank's fp64 partial of the global norm: the sum of the p-th powers of fp32
    ``norms`` (:func:`block_norms` of each gradient piece), or their max for ``inf``; a 0-d
    fp64 tensor on ``device`` (0 without norms). See [Note: Sharded grad norm]."""
    parts = [n.reshape(-1).to(device=device, dtype=torch.float64) for n in norms]
    parts = [p for p in parts if p.numel()]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    if math.isinf(norm_type):
        return flat.max()
    if norm_type == 2.0:
        return flat.square().sum()
    return flat.pow(norm_type).sum()


@dataclass(frozen=True)
class GradNorm:
    """What every rank gets from :func:`agree_grad_norm` (the same values on every rank)."""

    total: torch.Tensor
    """The global norm before clipping (fp32 0-d, on the partial's device), like the value
    torch.nn.utils.clip_grad_norm_ returns."""
    coef: torch.Tensor
    """``clamp(max_norm / (total + 1e-6), max=1.0)`` (fp32 0-d): multiply the gradients by it."""
    flags: tuple[tuple[bool, ...], ...]
    """Every rank's ``flags``, in group rank order."""


def agree_grad_norm(
    partial: torch.Tensor,
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup,
    *,
    flags: Sequence[bool] = (),
    all_gather: AllGather | None = None,
) -> GradNorm:
    """The global gradient norm and clip coefficient from every rank's partial; checks on every
    rank that every rank clips alike. Collective over ``group``: one all-gather of one fp64 row
    per rank, ``[partial, max_norm, norm_type, *flags]``. See [Note: Sharded grad norm].

    Args:
        partial: this rank's :func:`grad_norm_partial` (fp64 0-d).
        max_norm, norm_type: this rank's arguments (floats, see :func:`check_clip_args`).
        group: the process group whose ranks hold the gradient pieces (every rank calls this).
        flags: per-rank booleans of the caller, returned for every rank in :attr:`GradNorm.flags`
            (every rank passes as many).
        all_gather: the all-gather to issue, ``(out, inp, group)`` (see :data:`AllGather`;
            e.g. a driver's counting one); default: a plain all-gather over ``group``.

    Returns:
        The total norm, the clip coefficient and every rank's flags.

    Raises:
        ValueError: on every rank, when ranks pass different ``(max_norm, norm_type)`` (naming
            each rank's values), or when ``max_norm`` is negative or NaN or ``norm_type`` is
            not positive.
    """
    device = partial.device
    wire = device if _reduces_on(group, device) else _comm_device(group)
    row = torch.tensor(
        [0.0, max_norm, norm_type, *(float(bool(f)) for f in flags)],
        dtype=torch.float64,
        device=wire,
    )
    row[0] = partial.to(device=wire, dtype=torch.float64)
    world = dist.get_world_size(group)
    out = torch.empty(world * row.numel(), dtype=torch.float64, device=wire)
    if all_gather is None:
        all_gather_single(out, row, group=group)
    else:
        all_gather(out, row, group)
    rows = out.view(world, row.numel())
    table = rows[:, 1:].tolist()  # the one host sync
    settings = [(s[0], s[1]) for s in table]
    if any(repr(s) != repr(settings[0]) for s in settings):
        raise ValueError(
            "clip_grad_norm: ranks pass different (max_norm, norm_type): "
            + ", ".join(f"rank {r}: {s}" for r, s in enumerate(settings))
            + "; pass the same values on every rank"
        )
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm!r}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")
    partials = rows[:, 0]
    if math.isinf(norm_type):
        total = partials.max()
    else:
        total = partials.sum().pow(1.0 / norm_type)
    total = total.to(device=device, dtype=torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return GradNorm(total, coef, tuple(tuple(v > 0.5 for v in s[2:]) for s in table))


def _clip_grad_norm(
    owned: list[torch.Tensor],
    params: list[torch.Tensor],
    max_f: float,
    norm_f: float,
    group: dist.ProcessGroup,
    masters: MasterSet | None = None,
) -> torch.Tensor:
    """ZeRO-1's clip, with arguments from :func:`check_clip_args`: see [Note: Sharded grad
    norm]; with ``masters``, [Note: Master weights]."""
    grads = [p.grad for p in owned if p.grad is not None]
    # The norm lives where the grads do (as with torch.nn.utils.clip_grad_norm_); only a
    # backend that cannot reduce there (NCCL with host grads) gets a copy on its own device.
    device = grads[0].device if grads else params[0].device if params else _comm_device(group)
    norms = [_norms(p, norm_f, masters) for p in owned if p.grad is not None]
    partial = grad_norm_partial(norms, norm_f, device)
    norm = agree_grad_norm(partial, max_f, norm_f, group)
    if masters is not None:
        masters.factors.add(norm.coef)  # applied to the fp32 grads at the step
    local_grads = [
        p.grad for p in params if p.grad is not None and (masters is None or not masters.covers(p))
    ]
    for g in local_grads:
        g.detach().mul_(norm.coef.to(device=g.device, dtype=g.dtype))
    return norm.total


def _norms(p: torch.Tensor, norm_type: float, masters: MasterSet | None) -> torch.Tensor:
    """:func:`block_norms` of ``p``'s gradient; with a master, of its upcast gradient times the
    pending factors (computed on one param's fp32 temporary, as the step will see it)."""
    g = p.grad
    assert g is not None  # filtered by the caller
    if masters is None or not masters.has(p):
        return block_norms(g, norm_type)
    g32 = g.detach().to(masters.dtype)
    masters.factors.apply(g32)
    return block_norms(g32, norm_type)
