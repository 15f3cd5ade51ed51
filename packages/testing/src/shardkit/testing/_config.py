"""Configuration of a test world: how many ranks, which backend, how long a test may run."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_WORLD_SIZE",
    "SUPPORTED_BACKENDS",
    "WorldSpec",
    "default_timeout",
]

SUPPORTED_BACKENDS: tuple[str, ...] = ("gloo", "nccl")
"""Backends a world can be started with."""

MAX_WORLD_SIZE = 8
"""Largest world the plugin starts (each rank is a full Python process importing torch)."""

DEFAULT_TIMEOUT_S = 120.0
"""Per-test timeout when neither the decorator, ``--shardkit-timeout`` nor
``SHARDKIT_TEST_TIMEOUT`` says otherwise: generous for a loaded 2-core CI machine."""

_TIMEOUT_ENV = "SHARDKIT_TEST_TIMEOUT"


def default_timeout() -> float:
    """The per-test timeout in seconds from ``SHARDKIT_TEST_TIMEOUT``, else the default.

    Raises:
        ValueError: if the environment variable is set but is not a positive number.
    """
    raw = os.environ.get(_TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{_TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}; "
            f"unset it or set e.g. {_TIMEOUT_ENV}=300"
        ) from None
    if value <= 0:
        raise ValueError(f"{_TIMEOUT_ENV} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class WorldSpec:
    """What a world is: worlds with equal specs are shared between tests."""

    world_size: int
    """Number of rank processes (1 to :data:`MAX_WORLD_SIZE`)."""

    backend: str = "gloo"
    """``"gloo"`` (CPU) or ``"nccl"`` (one CUDA device per rank)."""

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(
                f"world_size must be an int, got {type(self.world_size).__name__} "
                f"{self.world_size!r}"
            )
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(
                f"world_size must be between 1 and {MAX_WORLD_SIZE}, got {self.world_size}"
            )
        if self.backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"backend must be one of {SUPPORTED_BACKENDS}, got {self.backend!r}"
            )
