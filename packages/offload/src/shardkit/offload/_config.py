"""Configuration and argument validation shared by the public entry points."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OffloadConfig"]


@dataclass(frozen=True)
class OffloadConfig:
    """Settings of an offloaded model (validated; build it through the public constructors)."""

    device: torch.device
    """Where each slice computes (``cpu`` or ``cuda[:i]``)."""

    offload_device: torch.device
    """Where parameters, buffers and boundary activations live between uses (always ``cpu``)."""

    num_slices: int
    """Number of contiguous slices the layers are split into."""

    checkpoint_activation: bool
    """Recompute each slice in backward from its input kept on the offload device, instead of
    keeping all activations on the compute device."""

    num_microbatches: int
    """Number of chunks requested for the batch (dim 0 of every input), split with
    ``torch.chunk`` as fairscale does (the last chunk may be smaller, and there are fewer chunks
    when the batch does not fill them); each slice is loaded once and runs all micro-batches
    before the next slice."""

    stage_on_same_device: bool
    """Copy parameters into separate staging storage even when ``device == offload_device``.
    Slower; it runs the exact transfer path of a GPU on a CPU-only machine (tests, debugging)."""


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _check_device(name: str, value: object) -> torch.device:
    if isinstance(value, bool) or not isinstance(value, (str, torch.device, int)):
        raise TypeError(
            f"{name} must be a torch.device or a device string such as 'cuda:0' or 'cpu', "
            f"got {type(value).__name__} {value!r}"
        )
    try:
        device = torch.device(value)
    except RuntimeError as exc:
        raise ValueError(f"{name}={value!r} is not a valid device: {exc}") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{name} must be a 'cpu' or 'cuda' device, got {device}; other accelerators are "
            "not supported"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{name}={device} but CUDA is not available on this machine; use device='cpu'"
            )
        index: int | None = device.index
        if index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _make_config(
    device: object,
    offload_device: object,
    num_slices: int,
    checkpoint_activation: object,
    num_microbatches: object,
    stage_on_same_device: object,
) -> OffloadConfig:
    dev = _check_device("device", device)
    off = _check_device("offload_device", offload_device)
    if off.type != "cpu":
        raise ValueError(
            f"offload_device must be the CPU (host memory), got {off}; pass "
            "offload_device=torch.device('cpu')"
        )
    return OffloadConfig(
        device=dev,
        offload_device=off,
        num_slices=num_slices,
        checkpoint_activation=_check_bool("checkpoint_activation", checkpoint_activation),
        num_microbatches=_check_positive_int("num_microbatches", num_microbatches),
        stage_on_same_device=_check_bool("stage_on_same_device", stage_on_same_device),
    )
