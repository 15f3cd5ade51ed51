"""``ShardedOptimizer(..., compact_state=...)``'s wrapped optimizer: torch's Adam / AdamW with
block-quantized moments (issue 40).

[Note: Compact state under ZeRO-1]
With ``compact_state="int8"`` or ``"int4"`` the wrapped optimizer of ZeRO-1's ``LocalShards``
(and so of the overlap hook, which steps through it) is :func:`compact_class` of the class the
user passed: a subclass of ``torch.optim.Adam`` / ``AdamW`` with the same constructor, defaults
and hyper-parameters, whose ``step`` is :func:`~shardkit.optim._compact_step.compact_adam_step`
(torch's own functional Adam on dequantized chunks, requantized after: bit for bit the plain
optimizer whose moments are requantized after each step). Which params get compact moments is
:func:`~shardkit.optim._compact.compact_formats` of the stepped value (the fp32 param, or its
fp32 master: [Note: One compact decider]): ZeRO-1 owns whole params, so that is the param's
global size, the same at every world size, and blocks are never cut.

The state keeps torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), a
``CompactTensor`` in place of each compact moment. Everything that moves state between ranks or
to disk (consolidation, repartition, ``state_dict()``, sharded checkpoints) sees fp32 moments:
:func:`plain_state` dequantizes on the way out, and ``load_state_dict`` quantizes them again on
the way in (a load-state-dict post hook, torch's public API). quantize(dequantize(codes)) gives
the same codes ([Note: Signed scale] in ``_compact.py``), so a save, a consolidation or a reshard
N -> M and back is exact; a dict from a plain torch optimizer is quantized once. The cost: what
moves and what is written is fp32 (4 bytes per moment element), not the codes: storing codes in
sharded checkpoints is format 3's work (``docs/engine.md``, "Compact optimizer state").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from shardkit.optim._compact import CompactFormat, CompactTensor, compact_formats
from shardkit.optim._compact_step import AdamState, Impl, StepScratch, compact_adam_step
from torch.optim import Optimizer

__all__ = [
    "COMPACT_KINDS",
    "check_compact",
    "compact_class",
    "dequantize_state_dict",
    "is_compact_class",
    "plain_state",
    "quantize_state",
    "set_global_numels",
]

logger = logging.getLogger("shardkit.optim")
_logged_quantized = False

COMPACT_KINDS = ("int8", "int4")
"""The values ``compact_state`` takes (besides ``None``)."""

_BASES = (torch.optim.Adam, torch.optim.AdamW)
_KINDS: dict[type[Optimizer], str] = {}
"""The kind of each class :func:`compact_class` made."""
_CLASSES: dict[tuple[type[Optimizer], str, bool], type[Optimizer]] = {}
"""The class :func:`compact_class` made for each ``(base, kind, compiled)``."""


def check_compact(kind: object, optim_cls: type[Optimizer]) -> str | None:
    """``compact_state`` for ``optim_cls``: ``None`` or one of :data:`COMPACT_KINDS`.

    Raises:
        ValueError: an unknown kind.
        TypeError: an optimizer class other than ``torch.optim.Adam`` / ``AdamW``.
    """
    if kind is None:
        return None
    if not isinstance(kind, str) or kind not in COMPACT_KINDS:
        raise ValueError(
            f"compact_state must be None, 'int8' or 'int4', got {type(kind).__name__}: {kind!r}"
        )
    if optim_cls not in _BASES:
        raise TypeError(
            f"compact_state={kind!r} keeps Adam's moments block-quantized: it needs "
            f"optim=torch.optim.Adam or torch.optim.AdamW, got {optim_cls.__name__} (other "
            f"optimizers keep full-precision state: leave compact_state=None)"
        )
    return kind


def compact_class(base: type[Optimizer], kind: str, compiled: bool = True) -> type[Optimizer]:
    """``base`` (Adam or AdamW) with ``kind`` moments: see [Note: Compact state under ZeRO-1].

    ``compiled``: its step runs the compiled kernels (``compact_adam_step(compiled=True)``, see
    [Note: Compiled step, same bytes] in ``_compact_fused.py``), else the eager step. One class
    per ``(base, kind, compiled)``, made once.
    """
    made = _CLASSES.get((base, kind, compiled))
    if made is not None:
        return made
    adam_base = cast(type[torch.optim.Adam], base)

    class _Compact(adam_base):  # type: ignore[valid-type,misc]
        compiled_step = compiled
        """Whether the step runs the compiled kernels."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for g in self.param_groups:
                if g.get("capturable") or g.get("differentiable"):
                    raise ValueError(
                        f"compact_state={kind!r} does not support capturable=True or "
                        f"differentiable=True (the compact step is eager)"
                    )
            self.scratch: dict[torch.device, StepScratch] = {}
            self.global_numel: dict[int, int] = {}
            """``id(tensor) -> numel`` of the whole param a stepped piece belongs to (see
            :func:`set_global_numels`); a tensor not in it is a whole param."""
            self.register_load_state_dict_post_hook(quantize_state)

        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                states = [_state_of(self, p, group) for p in params]
                device = params[0].device
                scratch = self.scratch.setdefault(device, StepScratch())
                compact_adam_step(
                    params,
                    [p.grad for p in params],
                    states,
                    lr=_scalar(group["lr"]),
                    betas=(_scalar(group["betas"][0]), _scalar(group["betas"][1])),
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    decoupled_weight_decay=bool(
                        group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW))
                    ),
                    amsgrad=group["amsgrad"],
                    maximize=group["maximize"],
                    impl=_impl(group, params),
                    scratch=scratch,
                    compiled=self.compiled_step,
                )
            return loss

    _Compact.__name__ = _Compact.__qualname__ = f"Compact{base.__name__}"
    _KINDS[_Compact] = kind
    _CLASSES[(base, kind, compiled)] = _Compact
    return _Compact


def is_compact_class(cls: type[Optimizer]) -> bool:
    """Whether ``cls`` is a class :func:`compact_class` made."""
    return cls in _KINDS


def set_global_numels(opt: Optimizer, numels: Mapping[torch.Tensor, int]) -> None:
    """Tells a compact optimizer the whole-param size of each tensor it steps that is a piece
    of a param (ZeRO-2's fragments): whether a piece's moments are compact is decided on the
    whole param, so the same at every world size (see [Note: Block-aligned fragment buckets]
    in ``shardkit.optim._flat``). The tensors must outlive ``opt`` (they are its params)."""
    if is_compact_class(type(opt)):
        cast(Any, opt).global_numel.update({id(t): n for t, n in numels.items()})


def _scalar(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def _impl(group: Mapping[str, Any], params: list[torch.Tensor]) -> Impl:
    """torch's choice for the group: ``fused`` / ``foreach`` as set, else foreach on CUDA."""
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        foreach = all(p.is_cuda for p in params)
    return "foreach" if foreach else "single"


def _formats(opt: Optimizer, p: torch.Tensor) -> tuple[CompactFormat, CompactFormat] | None:
    """``p``'s moment formats (``p`` is the stepped value): [Note: One compact decider]."""
    numel = cast(Any, opt).global_numel.get(id(p), p.numel())
    return compact_formats(_KINDS[type(opt)], numel, p.dtype, stepped=p.dtype)


def _kind(opt: Optimizer, p: torch.Tensor) -> str | None:
    return _KINDS[type(opt)] if _formats(opt, p) is not None else None


def _state_of(opt: Optimizer, p: torch.Tensor, group: Mapping[str, Any]) -> AdamState:
    """``p``'s state as an ``AdamState`` over the same objects (created on the first step)."""
    st = opt.state[p]
    amsgrad = bool(group["amsgrad"])
    if not st:
        fresh = AdamState.zeros(p, _kind(opt, p), amsgrad=amsgrad, fused=bool(group.get("fused")))
        st["step"] = fresh.step
        for name, m in fresh.moments():
            st[name] = m
    return AdamState(st["step"], st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"))


def quantize_state(opt: Optimizer) -> None:
    """After a load (``load_state_dict``'s post hook, or a driver that wrote ``opt.state``):
    the moments of compact params become compact in the optimizer's format, the others fp32.

    fp32 moments of a compact param are quantized (exact for moments that were compact when
    saved: [Note: Compact state under ZeRO-1]); a ``CompactTensor`` (a format-3 checkpoint,
    [Note: Compact checkpoint items] in ``shardkit.optim._checkpoint``) is kept when its format
    is the param's, re-quantized from its values when it is another kind's, and dequantized for
    a param that keeps fp32 state. No-op for other optimizers.

    Raises:
        ValueError: a ``CompactTensor`` with another number of elements than its param.
    """
    if not is_compact_class(type(opt)):
        return
    global _logged_quantized
    n = 0
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            formats = _formats(opt, p)
            for name, which in (("exp_avg", 0), ("exp_avg_sq", 1), ("max_exp_avg_sq", 1)):
                value = st.get(name)
                fmt = formats[which] if formats is not None else None
                if isinstance(value, CompactTensor):
                    if value.numel != p.numel():
                        raise ValueError(
                            f"load_state_dict: compact {name!r} holds {value.numel} elements "
                            f"but its param has {p.numel()}: the state was saved for another "
                            f"model"
                        )
                    if fmt is None:
                        st[name] = value.dequantize().to(p.device).view(p.shape)
                    elif value.fmt == fmt:
                        st[name] = _on(value, p.device)
                    else:
                        st[name] = CompactTensor.from_tensor(
                            value.dequantize().to(p.device).view(p.shape), fmt
                        )
                        n += 1
                elif isinstance(value, torch.Tensor) and fmt is not None:
                    st[name] = CompactTensor.from_tensor(value.to(p.device, torch.float32), fmt)
                    n += 1
    if n and not _logged_quantized:
        _logged_quantized = True
        logger.info(
            "load_state_dict: %d moment(s) quantized into this optimizer's compact format "
            "(exact for a state that was compact in the same format when saved; logged once)",
            n,
        )


def _on(value: CompactTensor, device: torch.device) -> CompactTensor:
    if value.device == device:
        return value
    return CompactTensor(value.codes.to(device), value.scales.to(device), value.shape, value.fmt)


def dequantize_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` (a plain torch optimizer dict) with every ``CompactTensor`` in its
    ``"state"`` dequantized to an fp32 tensor: what a plain optimizer, or one without
    ``compact_state``, loads. A shallow copy: the caller's dict is not modified."""
    state = state_dict.get("state")
    if not isinstance(state, Mapping) or not any(
        isinstance(v, CompactTensor)
        for entry in state.values()
        if isinstance(entry, Mapping)
        for v in entry.values()
    ):
        return dict(state_dict)
    out = dict(state_dict)
    out["state"] = {
        i: plain_state(entry) if isinstance(entry, Mapping) else entry for i, entry in state.items()
    }
    return out


def plain_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """One param's state with its compact moments dequantized to fp32 tensors (new ones, of
    the shape each stands for); other values as they are. See [Note: Compact state under
    ZeRO-1]."""
    return {k: v.dequantize() if isinstance(v, CompactTensor) else v for k, v in state.items()}
