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
        num_slices: Number of slices for an ``nn.Sequential`` (default 3); a value above its
            number of layers is clamped to it. Ignored for pre-split slices (each module is one
            slice), as in fairscale's ``OffloadModel``; both cases are logged.
        checkpoint_activation: Keep only each slice's input (on the offload device) and
            recompute the slice in backward, restoring RNG and autocast state.
        num_microbatches: Split the batch (dim 0 of every input) with
            ``torch.chunk(x, num_microbatches)``, as fairscale does: chunks of
            ``ceil(B / num_microbatches)`` rows, the last one smaller, and fewer chunks than
            requested when the batch does not fill them (a batch of 6 in 4 micro-batches runs
            as 2 + 2 + 2). Every slice is loaded once and runs them all before the next slice.
        stage_on_same_device: Use separate staging storage even when ``device`` equals
            ``offload_device`` (exercises the GPU transfer path on a CPU; slower).

    Moving the wrapper: ``.cpu()``, ``.cuda()`` and ``.to(device)`` onto the offload device or
    the compute device return it unchanged (parameters stay on the host, slices keep computing
    on ``device``; a move onto the offload device also evicts a slice left resident on the
    device); a move to another device or a dtype cast (``.half()``, ``.to(torch.float64)``)
    raises ``RuntimeError``: cast or choose the device before wrapping.

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

    # [Note: Moving an OffloadModel]
    # Parameters and buffers are views of flat host buffers that the engine owns; the engine
    # copies each slice to ``device`` when it runs. fairscale's OffloadModel has no .to() of its
    # own: .cpu() leaves its (host) parameters where they are and .cuda() moves them to the GPU
    # only until each slice's first forward drops it back to the offload device, so in effect
    # neither changes where it computes or where parameters live. Here that is made explicit: a
    # move onto the offload device or onto the compute device (.cpu(), .cuda(), .to(device),
    # also from a parent module's .to()) keeps the parameters on the host and the compute device
    # unchanged; a move onto the offload device also evicts any slice left resident on the
    # compute device (after a forward whose backward never ran). A move to any other device, or
    # a cast to another dtype, raises: it cannot keep these semantics. What a move would do is
    # read by applying it to an empty tensor of each parameter/buffer dtype on the host, so
    # every Module method built on _apply (.to, .cpu, .cuda, .half, .double, .type, ...) is
    # handled the way nn.Module would apply it.
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        config = self.config
        tensors = [*self.module.parameters(), *self.module.buffers()]
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            probe = torch.empty(0, dtype=dtype, device=config.offload_device)
            moved = fn(probe)
            if moved.dtype != dtype:
                raise RuntimeError(
                    f"OffloadModel cannot cast its parameters after wrapping (this call turns "
                    f"{dtype} tensors into {moved.dtype}): they are views of host buffers the "
                    "offload engine owns; cast the model before wrapping it (model.to(dtype), "
                    "then OffloadModel(model, ...)), or use torch.autocast for mixed precision"
                )
            if moved.device not in (config.device, config.offload_device):
                accepted = f".cpu()/.to('{config.offload_device}')"
                if config.device != config.offload_device:
                    accepted += f" and .to('{config.device}')"
                raise RuntimeError(
                    f"OffloadModel computes on {config.device} and keeps its parameters on "
                    f"{config.offload_device}; moving it to {moved.device} is not supported "
                    f"after wrapping ({accepted} are accepted and keep the parameters on the "
                    f"host); to compute on {moved.device}, pass device='{moved.device}' when "
                    "wrapping"
                )
            if moved.device == config.offload_device:
                self._engine.release_all()
        logger.debug(
            "OffloadModel: move ignored: parameters stay on %s, slices compute on %s",
            config.offload_device,
            config.device,
        )
        return self


def _split_model(model: object, num_slices: int | None) -> list[nn.Module]:
    # [Note: fairscale's num_slices]
    # fairscale's OffloadModel (num_slices defaults to 3 there) clamps num_slices to the length
    # of an nn.Sequential and ignores it for a pre-split list, where each module is one slice.
    # Code written for it passes both, so both are accepted here (with a log line), not refused.
    n = None if num_slices is None else _check_positive_int("num_slices", num_slices)
    if isinstance(model, nn.Sequential):
        layers = list(model)
        if len(layers) == 0:
            raise ValueError("model is an empty nn.Sequential; there is nothing to offload")
        if n is None:
            n = min(3, len(layers))
        elif n > len(layers):
            logger.info(
                "OffloadModel: num_slices=%d exceeds the %d layers of the nn.Sequential; using "
                "%d slices (one layer each), as fairscale's OffloadModel does",
                n,
                len(layers),
                len(layers),
            )
            n = len(layers)
        ranges = balanced_slices([module_bytes(m) for m in layers], n)
        return [_SliceModule(layers[r.start : r.stop], r) for r in ranges]
    if isinstance(model, (list, tuple, nn.ModuleList)):
        mods = list(model)
        if not mods or not all(isinstance(m, nn.Module) for m in mods):
            raise TypeError(
                "a list of slices must be a non-empty list of nn.Module, got "
                f"{[type(m).__name__ for m in mods]}"
            )
        if n is not None and n != len(mods):
            logger.info(
                "OffloadModel: num_slices=%d is ignored for a pre-split list of %d modules: "
                "each module is one slice, as in fairscale's OffloadModel (pass an "
                "nn.Sequential to have it split into num_slices)",
                n,
                len(mods),
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
