"""OffloadModel: an nn.Sequential run slice by slice from host memory."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from shardkit.offload._config import OffloadConfig, _check_positive_int, _make_config
from shardkit.offload._engine import (
    Boundary,
    _as_boundary,
    _Engine,
    _from_boundary,
    _OffloadFunction,
)
from shardkit.offload._planning import balanced_slices, module_bytes
from torch import nn

_CPU = torch.device("cpu")

__all__ = ["OffloadModel"]

logger = logging.getLogger("shardkit.offload")
_logged_in_place = False


class OffloadModel(nn.Module):
    """Run an ``nn.Sequential`` slice by slice, keeping its parameters on the host.

    The layers are split into ``num_slices`` contiguous slices balanced by parameter and buffer
    bytes (an optimal linear partition). Each slice is copied to ``device`` only for its
    forward and its backward, while the next one is prefetched; at most two slices are resident
    on ``device`` at any time. Parameters stay on ``offload_device``, so an ordinary optimizer
    steps them there, and gradients arrive in their ``.grad`` on the host.

    Args:
        model: An ``nn.Sequential``, or a list/tuple/``nn.ModuleList`` of modules that are
            already the slices (each applied to the previous one's output).
        device: Compute device (``cuda[:i]`` or ``cpu``).
        offload_device: Host device where parameters live (must be the CPU).
        num_slices: Number of slices for an ``nn.Sequential`` (default 3, at most its length).
            For pre-split slices it defaults to, and must equal, their number.
        checkpoint_activation: Keep only each slice's input (on the offload device) and
            recompute the slice in backward, restoring RNG and autocast state.
        num_microbatches: Split the batch (dim 0 of every input) into this many micro-batches;
            every slice is loaded once and runs them all before the next slice.
        stage_on_same_device: Use separate staging storage even when ``device`` equals
            ``offload_device`` (exercises the GPU transfer path on a CPU; slower).

    Raises:
        TypeError: ``model`` is not a Sequential or list of modules, or an argument has the
            wrong type.
        ValueError: an argument is out of range, or a parameter is shared between slices.
    """

    def __init__(
        self,
        model: nn.Sequential | Sequence[nn.Module],
        device: torch.device | str,
        offload_device: torch.device | str = _CPU,
        num_slices: int | None = None,
        checkpoint_activation: bool = False,
        num_microbatches: int = 1,
        *,
        stage_on_same_device: bool = False,
    ) -> None:
        super().__init__()
        slices = _split_model(model, num_slices)
        config = _make_config(
            device,
            offload_device,
            len(slices),
            checkpoint_activation,
            num_microbatches,
            stage_on_same_device,
        )
        self.config = config
        self.module = model if isinstance(model, nn.Module) else nn.ModuleList(list(model))
        _check_no_sharing(slices)
        staged = config.stage_on_same_device or config.device != config.offload_device
        if not staged:
            global _logged_in_place
            if not _logged_in_place:
                _logged_in_place = True
                logger.info(
                    "OffloadModel: device and offload_device are both %s: the slices run in "
                    "place, with no staging copies (nothing is offloaded; pass "
                    "stage_on_same_device=True to exercise the transfer path)",
                    config.device,
                )
        self._engine = _Engine(
            slices,
            config.device,
            config.offload_device,
            config.checkpoint_activation,
            config.num_microbatches,
            staged,
        )

    @property
    def slice_ranges(self) -> list[range]:
        """Which top-level layers each slice holds (for an ``nn.Sequential``)."""
        return [s.layer_range for s in self._engine.slices if isinstance(s, _SliceModule)]

    def forward(self, inputs: Any) -> Any:
        """Run the model on ``inputs`` (a Tensor or tuple/list of Tensors, as ``nn.Sequential``)."""
        x, kind = _as_boundary(inputs, "the input of OffloadModel")
        return _run(self._engine, self.config, x, kind)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        raise RuntimeError(
            "OffloadModel manages where its parameters live (.to(), .cuda(), .half(), ... are "
            "not supported after wrapping); move or cast the model before wrapping it and pass "
            "device=... to OffloadModel"
        )


def _split_model(model: object, num_slices: int | None) -> list[nn.Module]:
    if isinstance(model, nn.Sequential):
        n = 3 if num_slices is None else _check_positive_int("num_slices", num_slices)
        layers = list(model)
        if len(layers) == 0:
            raise ValueError("model is an empty nn.Sequential; there is nothing to offload")
        if n > len(layers):
            raise ValueError(
                f"num_slices={n} exceeds the number of layers of the nn.Sequential "
                f"({len(layers)}); pass num_slices <= {len(layers)}"
            )
        ranges = balanced_slices([module_bytes(m) for m in layers], n)
        return [_SliceModule(layers[r.start : r.stop], r) for r in ranges]
    if isinstance(model, (list, tuple, nn.ModuleList)):
        mods = list(model)
        if not mods or not all(isinstance(m, nn.Module) for m in mods):
            raise TypeError(
                "a list of slices must be a non-empty list of nn.Module, got "
                f"{[type(m).__name__ for m in mods]}"
            )
        if num_slices is not None and num_slices != len(mods):
            raise ValueError(
                f"num_slices={num_slices} but {len(mods)} pre-split slices were given; omit "
                "num_slices or pass an nn.Sequential to have it split"
            )
        return [_SliceModule([m], range(k, k + 1)) for k, m in enumerate(mods)]
    raise TypeError(
        f"OffloadModel wraps an nn.Sequential or a list of slice modules, got "
        f"{type(model).__name__}; for a model that calls a stack of blocks itself (a "
        "transformer's nn.ModuleList of layers), use shardkit.offload.offload_blocks"
    )


class _SliceModule(nn.Sequential):
    """The layers of one slice (not registered in the wrapper: state_dict keys are unchanged)."""

    def __init__(self, layers: list[nn.Module], layer_range: range) -> None:
        super().__init__(*layers)
        self.layer_range = layer_range


def _check_no_sharing(slices: list[nn.Module]) -> None:
    owner: dict[int, int] = {}
    for i, s in enumerate(slices):
        for name, t in [*s.named_parameters(), *s.named_buffers()]:
            j = owner.setdefault(id(t), i)
            if j != i:
                raise ValueError(
                    f"tensor {name!r} of slice {i} is also used by slice {j}; a parameter or "
                    "buffer shared between slices (tied weights) cannot be offloaded slice by "
                    "slice; keep the layers that share it in one slice (pre-split the model)"
                )


def _run(engine: _Engine, config: OffloadConfig, x: Boundary, kind: str) -> Any:
    x = tuple(t.to(config.device) if t.device != config.device else t for t in x)
    _check_microbatches(x, config.num_microbatches)
    params = [p for store in engine.stores for p in store.host_params()]
    needs_backward = torch.is_grad_enabled() and (any(t.requires_grad for t in x) or bool(params))
    if not needs_backward:
        out, out_kind = engine.forward(x, kind, None)
        return _from_boundary(out, out_kind)
    kinds: list[str] = []
    out = _OffloadFunction.apply(  # type: ignore[no-untyped-call]
        engine, kind, kinds, len(x), *x, *params
    )
    return _from_boundary(tuple(out), kinds[0])


def _check_microbatches(x: Boundary, num: int) -> None:
    if num == 1:
        return
    sizes = []
    for k, t in enumerate(x):
        if t.dim() == 0:
            raise ValueError(
                f"input {k} is 0-dimensional but num_microbatches={num} splits dim 0; pass "
                "batched inputs or num_microbatches=1"
            )
        sizes.append(t.shape[0])
    if len(set(sizes)) != 1:
        raise ValueError(
            f"with num_microbatches={num} every input must have the same batch size (dim 0), "
            f"got {sizes}"
        )
    if sizes[0] % num != 0:
        raise ValueError(
            f"batch size {sizes[0]} is not divisible into num_microbatches={num} micro-batches; "
            f"pass a batch size that is a multiple of {num} or change num_microbatches"
        )
