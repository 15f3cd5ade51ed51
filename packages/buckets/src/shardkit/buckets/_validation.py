"""Argument checks shared by the buckets and the planner.

Every check raises ``TypeError`` / ``ValueError`` with a message that says what was expected,
what was received and how to fix it.
"""

from __future__ import annotations

import torch

__all__: list[str] = []


def _describe(tensor: torch.Tensor, name: str | None) -> str:
    """A short human-readable label for a tensor, used in error messages."""
    label = f"param {name!r}" if name else "param"
    return (
        f"{label} (shape {tuple(tensor.shape)}, numel {tensor.numel()}, "
        f"dtype {tensor.dtype}, device {tensor.device})"
    )


def _check_int(value: object, what: str, *, minimum: int) -> int:
    """Check that ``value`` is a plain ``int`` (not a ``bool``) that is at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{what} must be an int >= {minimum}; got {type(value).__name__} {value!r}. "
            f"Pass a plain Python int."
        )
    if value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}; got {value}.")
    return value


def _check_dtype(value: object, what: str) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{what} must be a torch.dtype such as torch.float32; got {type(value).__name__} "
            f"{value!r}."
        )
    return value


def _check_device(value: object, what: str) -> torch.device:
    if isinstance(value, bool) or not isinstance(value, torch.device | str | int):
        raise TypeError(
            f"{what} must be a torch.device, a device string such as 'cpu' or 'cuda:0', or a "
            f"CUDA device index; got {type(value).__name__} {value!r}."
        )
    try:
        return torch.device(value)
    except RuntimeError as err:
        raise ValueError(f"{what} is not a valid device: {value!r} ({err}).") from err


def _check_name(name: object) -> str | None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None; got {type(name).__name__} {name!r}.")
    return name


def _check_flat_candidate(tensor: object, name: str | None, *, what: str) -> torch.Tensor:
    """Checks common to everything that becomes a view of a flat buffer.

    ``tensor`` must be a dense, contiguous, leaf tensor. ``what`` names the operation in the
    error message (for example ``"ParamBucket.add_param"``).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{what} expects a torch.Tensor (usually an nn.Parameter); got "
            f"{type(tensor).__name__} {tensor!r:.80}."
        )
    if tensor.layout != torch.strided:
        raise ValueError(
            f"{what}: {_describe(tensor, name)} has layout {tensor.layout}; only dense "
            f"(torch.strided) tensors can live in a flat buffer. Keep sparse params out of the "
            f"bucket (for example, filter them before plan_buckets)."
        )
    if not tensor.is_leaf:
        raise ValueError(
            f"{what}: {_describe(tensor, name)} is not a leaf tensor (it was produced by "
            f"{type(tensor.grad_fn).__name__}); re-pointing its storage would not change what "
            f"autograd sees. Pass the nn.Parameter itself, or a detached tensor."
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what}: {_describe(tensor, name)} is not contiguous (strides "
            f"{tuple(tensor.stride())}); its slot in the flat buffer would be contiguous and "
            f"change its memory layout. Make it contiguous first, e.g. "
            f"`p.data = p.data.contiguous()`."
        )
    return tensor
