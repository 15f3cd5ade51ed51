"""The pending multiplications of fp32 gradients (loss scaler's ``1/scale``, clip coefficient).

The masters of ZeRO-1 and ZeRO-2 (one :class:`~shardkit.optim._master_set.MasterSet` each) queue
the same factors and apply them the same way: see [Note: Master weights].
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["GradFactors"]


class GradFactors:
    """Multiplications queued for the next step's upcast (master-dtype) gradients, in order.

    Gradients stepped through a master are never unscaled or clipped in place: the loss
    scaler's ``1/scale`` and the clip coefficient are queued here and applied to the upcast
    gradient, one multiplication each in order, which gives bit for bit what unscaling and
    clipping fp32 gradients in place gives. The step consumes them; ``zero_grad`` and a
    skipped step drop them. See [Note: Master weights].
    """

    def __init__(self) -> None:
        self._factors: list[torch.Tensor] = []

    def add(self, factor: torch.Tensor) -> None:
        """Queues a multiplication by ``factor`` (a one-element tensor, kept as an fp32 0-d
        copy)."""
        self._factors.append(factor.detach().to(dtype=torch.float32).reshape(()).clone())

    def apply(self, grad: torch.Tensor) -> None:
        """Multiplies ``grad`` in place by every queued factor, in order (cast to its dtype)."""
        for f in self._factors:
            grad.mul_(f.to(device=grad.device, dtype=grad.dtype))

    def clear(self) -> None:
        """Drops every queued factor."""
        self._factors.clear()

    def __len__(self) -> int:
        return len(self._factors)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._factors)
