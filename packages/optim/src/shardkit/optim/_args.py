"""Checks of ``ShardedOptimizer``'s constructor arguments (type, value, what to write instead)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.optim import Optimizer

__all__ = ["check_chunk_bytes", "check_optim_class", "check_timeout"]


def check_optim_class(optim: object, defaults: dict[str, Any]) -> type[Optimizer]:
    """``optim`` as the torch optimizer class to shard.

    Raises:
        TypeError: torch ZeroRedundancyOptimizer's ``optimizer_class=`` keyword, or ``optim``
            is not an ``Optimizer`` subclass.
    """
    if "optimizer_class" in defaults:
        raise TypeError(
            "ShardedOptimizer takes the optimizer class as optim= (fairscale's keyword); "
            "optimizer_class= is torch ZeroRedundancyOptimizer's. Write "
            "ShardedOptimizer(params, optim=torch.optim.Adam, lr=...), or use "
            "shardkit.optim.ZeroRedundancyOptimizer, which has torch's signature."
        )
    if not (isinstance(optim, type) and issubclass(optim, Optimizer)):
        raise TypeError(
            f"optim must be a torch.optim.Optimizer subclass (the class, e.g. "
            f"torch.optim.Adam), got {type(optim).__name__}: {optim!r}. Pass the class and "
            f"its arguments as keywords: ShardedOptimizer(params, torch.optim.Adam, lr=1e-3)."
        )
    return optim


def check_chunk_bytes(value: object) -> int | None:
    """``master_grad_bucket_bytes``: a positive int or ``None``.

    Raises:
        ValueError: anything else.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(
            f"master_grad_bucket_bytes must be a positive int (bytes of fp32 gradients upcast "
            f"at a time) or None (all at once), got {type(value).__name__}: {value!r}"
        )
    return value


def check_timeout(value: object) -> timedelta | None:
    """``collective_timeout``: positive seconds, a positive ``timedelta``, or ``None``.

    Raises:
        ValueError: anything else.
    """
    if value is None or isinstance(value, timedelta):
        if isinstance(value, timedelta) and value.total_seconds() <= 0:
            raise ValueError(f"collective_timeout must be positive, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"collective_timeout must be a positive number of seconds, a timedelta or None, got "
            f"{type(value).__name__}: {value!r}"
        )
    return timedelta(seconds=float(value))
