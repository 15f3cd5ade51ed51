"""Full-precision master copies of the params this rank owns (``master_dtype``).

[Note: Master weights]
With ``master_dtype=torch.float32`` and a bf16/fp16 model, the wrapped optimizer does not step the
model's params: it steps an fp32 *master* copy of each param this rank owns (trainable, floating,
of another dtype than ``master_dtype``; a param already in ``master_dtype`` is stepped as is), so
the optimizer state is fp32 too and nothing is rounded to the model's precision but the model
params themselves. A step, per chunk of owned params (``master_grad_bucket_bytes`` of fp32
gradients at most; one chunk when ``None``):

1. the chunk's low-precision grads are upcast into one flat fp32 buffer, multiplied by the
   pending gradient factors if any (the loss scaler's ``1/scale``, then the clip coefficient,
   see below), and the buffer's views become the masters' ``.grad``;
2. the wrapped optimizer steps the chunk's masters (``_step_local`` narrows its groups, as for
   the per-bucket step of shardkit-overlap);
3. the new master values are cast into the model params (``p.copy_(master)``) and the masters'
   ``.grad`` dropped.

So no fp32 copy of every grad exists at once: the extra memory is one chunk, one buffer per
device allocated by the first step (the size of the largest chunk) and reused by every chunk
and step after it, so no step allocates a gradient-sized tensor (issue 37: a buffer freed and
allocated again every step stays resident under glibc anyway, and costs fresh pages). After the local
step, the params are synchronised as without masters (one broadcast per flat bucket, in the
model's dtype: half the bytes of fp32).

Unscaling and clipping act on the fp32 gradients, not on the model's ``.grad``: the
``ShardedGradScaler`` only checks the low-precision grads for inf/nan and hands ``1/scale`` to
the optimizer, and ``clip_grad_norm`` computes the norm in fp32 from the upcast owned grads
(times the pending factors) and queues the clip coefficient. Each factor is one multiplication
of the fp32 grads, in order, so the result is bit for bit what unscaling and clipping fp32
gradients in place gives. Unscaling fp16 grads in fp16 would underflow exactly the small
gradients loss scaling exists to keep. The factors are consumed by the next step and dropped by
``zero_grad``. The model's ``.grad`` keep their raw (scaled, unclipped) values; params without a
master (already in ``master_dtype``) are unscaled and clipped in place as usual.

Masters are created from the live params when a rank comes to own a param (construction,
``add_param_group``, ``refresh_trainable``, ``set_partition``); a param that keeps its owner
keeps its master, and one that changes owner takes its master along with its optimizer state
(its exact fp32 value, not the rounded param). In state dicts they travel under the top-level
key ``"master_params"`` (global index -> tensor), beside a plain torch ``"state"`` (the state of
the fp32 masters) and ``"param_groups"``: a plain torch optimizer loads such a dict (extra keys
are ignored) and the masters survive every save, consolidation and reshard exactly.

The masters themselves, ZeRO-1's and ZeRO-2's alike, are ``_master_set.py``'s
(:class:`~shardkit.optim._master_set.MasterSet`): this module holds what surrounds them (the
arguments' checks, their transport in state dicts, the unscale of local gradients).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

__all__: list[str] = []


MASTER_KEY = "master_params"
"""Top-level key of the master values in state dicts (global index -> tensor)."""

# Transport key of a master value inside one param's state entry while it moves between ranks
# (consolidation, repartition); never visible outside this package.
_WIRE_KEY = "__shardkit_master__"


def check_master_dtype(master_dtype: object, broadcast_fp16: bool) -> torch.dtype | None:
    """Validates the ``master_dtype`` argument."""
    if master_dtype is None:
        return None
    if not isinstance(master_dtype, torch.dtype) or not master_dtype.is_floating_point:
        raise TypeError(
            f"master_dtype must be a floating torch.dtype (torch.float32 for fp32 master weights "
            f"of a bf16/fp16 model) or None, got {type(master_dtype).__name__}: {master_dtype!r}"
        )
    if broadcast_fp16:
        raise ValueError(
            "broadcast_fp16=True cannot be combined with master_dtype: with master weights the "
            "params are already synchronised in the model's low precision (bf16/fp16) while the "
            "masters keep full precision. Drop broadcast_fp16."
        )
    return master_dtype


def check_master_remainder(value: object, master_dtype: torch.dtype | None) -> bool:
    """Validates ``master_remainder`` (see [Note: Remainder masters under ZeRO-1])."""
    if not isinstance(value, bool):
        raise TypeError(f"master_remainder must be a bool, got {type(value).__name__}: {value!r}")
    if value and master_dtype != torch.float32:
        raise ValueError(
            f"master_remainder=True keeps the fp32 master of each bf16 param as the param plus "
            f"an int16 remainder: it needs master_dtype=torch.float32, got master_dtype="
            f"{master_dtype}. Pass master_dtype=torch.float32 too, or drop master_remainder."
        )
    return value


def needs_master(p: torch.Tensor, master_dtype: torch.dtype | None) -> bool:
    """Whether an owned param gets a master: trainable, floating, not already in that dtype."""
    return (
        master_dtype is not None
        and p.requires_grad
        and p.is_floating_point()
        and p.dtype != master_dtype
    )


def split_wire(
    entries: dict[int, dict[str, object]],
) -> tuple[dict[int, dict[str, object]], dict[int, torch.Tensor]]:
    """Separates transported master values from the optimizer state (see ``_WIRE_KEY``)."""
    masters: dict[int, torch.Tensor] = {}
    state: dict[int, dict[str, object]] = {}
    for idx, entry in entries.items():
        value = entry.get(_WIRE_KEY)
        if isinstance(value, torch.Tensor):
            masters[idx] = value
        rest = {k: v for k, v in entry.items() if k != _WIRE_KEY}
        if rest:
            state[idx] = rest
    return state, masters


def join_wire(
    state: dict[int, dict[str, object]], masters: dict[int, torch.Tensor]
) -> dict[int, dict[str, object]]:
    """The inverse of :func:`split_wire`: masters ride in their param's state entry."""
    out = {idx: dict(entry) for idx, entry in state.items()}
    for idx, value in masters.items():
        out.setdefault(idx, {})[_WIRE_KEY] = value
    return out


def check_master_values(masters: object, params: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Validates a state dict's ``"master_params"`` against the params (indices, shapes)."""
    if not isinstance(masters, dict):
        raise TypeError(
            f"state_dict[{MASTER_KEY!r}] must be a dict of global param index -> tensor, got "
            f"{type(masters).__name__}"
        )
    for idx, value in masters.items():
        if not isinstance(idx, int) or not 0 <= idx < len(params):
            raise ValueError(
                f"state_dict[{MASTER_KEY!r}] has an entry for param {idx!r}; expected int "
                f"indices in [0, {len(params)}). It was saved for a different model."
            )
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(
                f"state_dict[{MASTER_KEY!r}][{idx}] must be a floating tensor, got "
                f"{type(value).__name__}"
            )
        if tuple(value.shape) != tuple(params[idx].shape):
            raise ValueError(
                f"state_dict[{MASTER_KEY!r}][{idx}] has shape {tuple(value.shape)} but param "
                f"{idx} has shape {tuple(params[idx].shape)}: it was saved for a different model."
            )
    return masters


def unscale_grads(
    grads: Iterable[tuple[torch.Tensor, bool]], inv_scale: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """``ShardedGradScaler``'s unscale of local gradients, ZeRO-1's and ZeRO-2's alike.

    Args:
        grads: ``(gradient, stepped through a master)`` pairs. Gradients without a master are
            multiplied by ``inv_scale`` in place; those with one are left as they are (the
            caller queues ``inv_scale`` as a factor, applied in fp32 to the upcast gradient).
        inv_scale: ``1 / scale``.

    Returns:
        One found-inf flag (fp32 0-d, 1.0 if any inf/nan) per device, torch's format.
    """
    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for g, has_master in grads:
            flag = found.setdefault(g.device, torch.zeros((), dtype=torch.float32, device=g.device))
            if not has_master:
                g.mul_(inv_scale.to(device=g.device, dtype=g.dtype))
            flag.copy_(torch.maximum(flag, (~torch.isfinite(g).all()).to(flag.dtype)))
    return found


def master_model_dict(
    model: nn.Module,
    masters: Mapping[int, torch.Tensor],
    index: Mapping[int, int],
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """``model``'s state dict at full precision, on the CPU: each param with a master (by global
    index, ``masters``; ``index`` maps ``id(param)`` to it) is its master, every other floating
    tensor upcast to ``dtype`` (exact), the rest copied. ZeRO-1's and ZeRO-2's
    ``master_model_state_dict``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        gi = index.get(id(value))
        if gi is not None and gi in masters:  # gathered for this dict: no second copy
            out[key] = masters[gi].to("cpu")
        elif value.is_floating_point():
            out[key] = value.detach().to("cpu", dtype, copy=True)
        else:
            out[key] = value.detach().to("cpu", copy=True)
    return out


def no_masters_error(what: str) -> RuntimeError:
    """The error of a call that needs master weights on an optimizer built without them."""
    return RuntimeError(
        f"{what}() needs master weights, and this ShardedOptimizer has master_dtype=None; "
        f"build it with master_dtype=torch.float32 (use the model's own state_dict() otherwise)"
    )
