"""offload_blocks: offload a stack of repeated blocks inside any model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from shardkit.offload._config import OffloadConfig, _make_config
from shardkit.offload._engine import _AutocastState, _Engine, _RngState
from torch import nn
from torch.func import functional_call

_CPU = torch.device("cpu")

__all__ = ["OffloadedBlocks", "offload_blocks"]


@dataclass(frozen=True)
class _CallSpec:
    """Where the tensors of a call go: top-level positional args and keyword values."""

    args: tuple[object, ...]  # a non-tensor value, or _TENSOR for the next tensor
    kwargs: tuple[tuple[str, object], ...]


_TENSOR = object()


def _flatten_call(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[_CallSpec, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    flat_args: list[object] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            tensors.append(a)
            flat_args.append(_TENSOR)
        else:
            flat_args.append(a)
    flat_kwargs: list[tuple[str, object]] = []
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            flat_kwargs.append((k, _TENSOR))
        else:
            flat_kwargs.append((k, v))
    return _CallSpec(tuple(flat_args), tuple(flat_kwargs)), tensors


def _unflatten_call(
    spec: _CallSpec, tensors: tuple[torch.Tensor, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    it = iter(tensors)
    args = tuple(next(it) if a is _TENSOR else a for a in spec.args)
    kwargs = {k: next(it) if v is _TENSOR else v for k, v in spec.kwargs}
    return args, kwargs


def _flatten_output(out: object, block: int) -> tuple[list[torch.Tensor], list[object], str]:
    """Split a block's output (a Tensor, or a tuple/list of Tensors and other values)."""
    if isinstance(out, torch.Tensor):
        return [out], [_TENSOR], "tensor"
    if isinstance(out, (tuple, list)):
        tensors = [v for v in out if isinstance(v, torch.Tensor)]
        for v in out:
            if isinstance(v, (tuple, list, dict)):
                raise TypeError(
                    f"block {block} returned a {type(out).__name__} containing a "
                    f"{type(v).__name__}; offloaded blocks must return a Tensor or a flat "
                    "tuple/list of Tensors and non-tensor values"
                )
        layout = [_TENSOR if isinstance(v, torch.Tensor) else v for v in out]
        return tensors, layout, "list" if isinstance(out, list) else "tuple"
    raise TypeError(
        f"block {block} returned {type(out).__name__}; offloaded blocks must return a Tensor "
        "or a flat tuple/list of Tensors and non-tensor values"
    )


def _unflatten_output(tensors: tuple[torch.Tensor, ...], layout: list[object], kind: str) -> Any:
    if kind == "tensor":
        return tensors[0]
    it = iter(tensors)
    values = [next(it) if v is _TENSOR else v for v in layout]
    return values if kind == "list" else tuple(values)


@dataclass
class _BlockRun:
    """What one block forward keeps for its backward."""

    spec: _CallSpec
    input_needs_grad: list[bool]
    autocast: _AutocastState
    graph: tuple[tuple[torch.Tensor, ...], list[torch.Tensor]] | None = None
    saved: tuple[torch.Tensor, ...] | None = None
    rng: _RngState | None = None


class _Blocks:
    """The engine plus the per-block calls (no micro-batches: the model owns the batch)."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine

    def call(self, i: int, x: tuple[torch.Tensor, ...], spec: _CallSpec, recompute: bool) -> Any:
        engine = self.engine
        engine._log("compute", i)  # noqa: SLF001 (same distribution)
        args, kwargs = _unflatten_call(spec, x)
        tensors = engine.stores[i].call_tensors(recompute)
        if tensors is None:
            return engine.slices[i](*args, **kwargs)
        return functional_call(engine.slices[i], tensors, args, kwargs)

    def grad_inputs(
        self, x: tuple[torch.Tensor, ...], needs: list[bool]
    ) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().requires_grad_(n) for t, n in zip(x, needs, strict=True))


class _BlockFunction(torch.autograd.Function):
    """One offloaded block as an autograd node; see [Note: Prefetch and residency]."""

    @staticmethod
    def forward(
        ctx: Any,
        blocks: _Blocks,
        i: int,
        spec: _CallSpec,
        meta: list[Any],
        num_inputs: int,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.set_materialize_grads(False)
        engine = blocks.engine
        x = tuple(tensors[:num_inputs])
        run = _BlockRun(
            spec,
            list(ctx.needs_input_grad[5 : 5 + num_inputs]),
            _AutocastState.capture(engine.device.type),
        )
        _enter(engine, i)
        if engine.checkpoint:
            run.saved = engine.save_boundary(i, x)
            run.rng = engine._capture_rng()  # noqa: SLF001 (same distribution)
            with run.autocast.context():
                out = blocks.call(i, x, spec, recompute=False)
            outs, layout, kind = _flatten_output(out, i)
        else:
            xd = blocks.grad_inputs(x, run.input_needs_grad)
            with torch.enable_grad(), run.autocast.context():
                out = blocks.call(i, xd, spec, recompute=False)
            outs, layout, kind = _flatten_output(out, i)
            run.graph = (xd, outs)
            outs = [t.detach() for t in outs]
        _leave_forward(engine, i, keep=True)
        meta.extend([layout, kind])
        ctx.blocks = blocks
        ctx.i = i
        ctx.run = run
        ctx.num_params = len(tensors) - num_inputs
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "offloaded blocks do not support double backward (create_graph=True)"
            )
        run: _BlockRun | None = ctx.run
        if run is None:
            raise RuntimeError(
                "an offloaded block's backward ran twice over the same forward; run the "
                "forward again instead of retain_graph=True"
            )
        ctx.run = None
        blocks: _Blocks = ctx.blocks
        engine = blocks.engine
        i: int = ctx.i
        engine.acquire(i)
        engine.prefetch(i - 1)
        store = engine.stores[i]
        if engine.checkpoint:
            assert run.saved is not None and run.rng is not None  # set by a checkpointed forward
            x = _load_input(engine, i, run.saved)
            xd = blocks.grad_inputs(x, run.input_needs_grad)
            with torch.enable_grad(), engine._restore_rng(run.rng), run.autocast.context():  # noqa: SLF001 (same distribution)
                out = blocks.call(i, xd, run.spec, recompute=True)
            outs, _, _ = _flatten_output(out, i)
        else:
            assert run.graph is not None  # set by a non-checkpointed forward
            xd, outs = run.graph
        pairs = [
            (t, g) for t, g in zip(outs, grads, strict=True) if t.requires_grad and g is not None
        ]
        input_grads, host = store.backward(pairs, xd, engine.streams, first=True, last=True)
        assert host is not None  # the last (only) micro-batch hands out the parameter gradients
        engine.release(i)
        if i == 0:
            engine.release_all()
        # The host gradients go straight to AccumulateGrad on the CPU: wait for their copies.
        engine.streams.synchronize(engine.streams.record_d2h())
        return (None, None, None, None, None, *input_grads, *host)


def _enter(engine: _Engine, i: int) -> None:
    if i == 0:
        engine.release_all()  # a new pass: nothing resident from before may be stale
    engine.acquire(i)
    engine.prefetch(i + 1)


def _leave_forward(engine: _Engine, i: int, keep: bool) -> None:
    if engine.stores[i].write_back_buffers(engine.streams):
        engine.streams.synchronize(engine.streams.record_d2h())
    if not (keep and i == len(engine.stores) - 1):
        engine.release(i)


def _load_input(
    engine: _Engine, i: int, saved: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    if i == 0 or not engine.staged:
        return saved
    out = []
    with engine.streams.on_h2d():
        for h in saved:
            t = torch.empty(h.shape, dtype=h.dtype, device=engine.device)
            t.copy_(h, non_blocking=True)
            out.append(t)
        ready = engine.streams.record_h2d()
    engine.streams.compute_wait(ready)
    for t in out:
        engine.streams.used_by_compute(t)
    return tuple(out)


class _OffloadedBlock(nn.Module):
    """Stands in for block ``index`` of the stack; state_dict keys stay those of the block."""

    def __init__(self, blocks: _Blocks, index: int, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self._blocks = blocks
        self._index = index
        self.register_state_dict_post_hook(_strip_block_prefix)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_add_block_prefix)  # type: ignore[no-untyped-call]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # The block's tensors are owned by the offload engine: model.to(device) moves the rest
        # of the model and leaves the offloaded blocks where they are.
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._blocks.engine
        spec, tensors = _flatten_call(args, kwargs)
        x = [t.to(engine.device) if t.device != engine.device else t for t in tensors]
        params = engine.stores[self._index].host_params()
        needs_backward = torch.is_grad_enabled() and (
            any(t.requires_grad for t in x) or bool(params)
        )
        if not needs_backward:
            _enter(engine, self._index)
            out = self._blocks.call(self._index, tuple(x), spec, recompute=False)
            _leave_forward(engine, self._index, keep=False)
            return out
        meta: list[Any] = []
        outs = _BlockFunction.apply(  # type: ignore[no-untyped-call]
            self._blocks, self._index, spec, meta, len(x), *x, *params
        )
        return _unflatten_output(tuple(outs), meta[0], meta[1])


def _strip_block_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = prefix + "block."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_block_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    for key in [
        k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "block.")
    ]:
        state_dict[prefix + "block." + key[len(prefix) :]] = state_dict.pop(key)


class OffloadedBlocks:
    """Handle returned by :func:`offload_blocks` (the model itself is modified in place)."""

    def __init__(self, config: OffloadConfig, blocks: _Blocks, module_list: nn.ModuleList) -> None:
        self.config = config
        self._blocks = blocks
        self.module_list = module_list

    @property
    def num_blocks(self) -> int:
        """How many blocks are offloaded (each is one slice)."""
        return len(self._blocks.engine.stores)

    def release(self) -> None:
        """Free any block still resident on the device (e.g. after a forward without backward)."""
        self._blocks.engine.release_all()


def offload_blocks(
    model: nn.Module,
    blocks: str | nn.ModuleList,
    device: torch.device | str,
    offload_device: torch.device | str = _CPU,
    checkpoint_activation: bool = False,
    *,
    stage_on_same_device: bool = False,
) -> OffloadedBlocks:
    """Offload a stack of repeated blocks inside ``model``; the rest of the model stays put.

    Each block of the ``nn.ModuleList`` is replaced in place by a stand-in that keeps the
    block's parameters on ``offload_device`` and brings them to ``device`` only for its
    forward and backward, prefetching the next block (forward) or previous one (backward), so at
    most two blocks are resident. The model's own ``forward`` is unchanged: it may call the
    blocks with any extra arguments (masks, positions, flags). Blocks should be called in order,
    once each per forward; another order is still correct but loses the prefetch.

    Args:
        model: Any module containing the stack. Move the rest of the model to ``device``
            yourself (the blocks are moved to ``offload_device`` here).
        blocks: The ``nn.ModuleList`` itself, or its dotted attribute path in ``model``
            (``"layers"``, ``"transformer.h"``).
        device: Compute device.
        offload_device: Host device where block parameters live (must be the CPU).
        checkpoint_activation: Recompute each block in backward from its input, kept on the
            offload device, restoring RNG and autocast state.
        stage_on_same_device: See :class:`OffloadConfig`.

    Returns:
        A handle with the config and :meth:`OffloadedBlocks.release`.

    Raises:
        TypeError: ``blocks`` is not an ``nn.ModuleList`` of ``model`` (or a path to one).
        ValueError: the stack is empty, already offloaded, or shares parameters between blocks.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(blocks, str):
        try:
            target = model.get_submodule(blocks)
        except AttributeError as exc:
            raise TypeError(
                f"model has no submodule {blocks!r}: {exc}; pass the dotted path of the "
                "nn.ModuleList of blocks (for example 'layers' or 'transformer.h')"
            ) from exc
    else:
        target = blocks
    if not isinstance(target, nn.ModuleList):
        raise TypeError(
            f"blocks must be an nn.ModuleList (or its path), got {type(target).__name__}"
        )
    if not any(m is target for m in model.modules()):
        raise TypeError("blocks is not a submodule of model; pass the model that contains it")
    if len(target) == 0:
        raise ValueError("the nn.ModuleList of blocks is empty; there is nothing to offload")
    if any(isinstance(b, _OffloadedBlock) for b in target):
        raise ValueError("these blocks are already offloaded; call offload_blocks once")
    from shardkit.offload._model import _check_no_sharing

    layers = list(target)
    config = _make_config(
        device, offload_device, len(layers), checkpoint_activation, 1, stage_on_same_device
    )
    _check_no_sharing(layers)
    staged = config.stage_on_same_device or config.device != config.offload_device
    engine = _Engine(
        layers, config.device, config.offload_device, config.checkpoint_activation, 1, staged
    )
    handle = _Blocks(engine)
    for k, block in enumerate(layers):
        target[k] = _OffloadedBlock(handle, k, block)
    return OffloadedBlocks(config, handle, target)
