"""One compiled kernel per chunk for compact Adam / AdamW state on a GPU (issue 51).

:func:`kernel_param_step` steps a param whose moments are all compact, :data:`FUSED_CHUNK`
elements at a time, with one ``torch.compile``-d function per chunk: it dequantizes the
moments, applies the Adam / AdamW update to the chunk's param and quantizes the moments back,
so inductor can fuse it into Triton kernels that read each moment's codes once and never store
its fp32 values; see [Note: One kernel on a GPU]. On the CPU the compiled halves of
``_compact_fused.py`` run around torch's own Adam instead (the same bytes as the eager step).

[Note: One kernel on a GPU]
On a GPU a step is memory-bound: torch's fused AdamW reads a param, its gradient and two fp32
moments and writes the param and the moments back (28 bytes per element), while one kernel over
int8 moments reads and writes 2 bytes of codes in their place (16 bytes per element, scales
included to within 2 %). The CPU's two compiled halves around torch's Adam would move 48: the
fp32 moments through memory three times. So off the CPU (:data:`KERNEL_DEVICES`) the update is
written here, in torch ops, as torch's single-tensor Adam / AdamW computes it: the gradient
negated (``maximize``) and decayed (``weight_decay``: ``grad + wd * param``, or AdamW's
``param * (1 - lr * wd)`` first), ``lerp`` for the first moment, ``v * beta2 + (1 - beta2) *
g * g`` for the second, the running maximum with ``amsgrad``, ``param + (-step_size) * m /
(sqrt(v) / sqrt(bias_correction2) + eps)``. The scalars are computed in double precision as
torch computes them (``step_size = lr / (1 - beta1 ** t)``, ...; where: [Note: Step scalars
without a sync]) and passed in one fp32 tensor (:func:`kernel_hypers`), so nothing that changes
per step is a constant of the graph and a step never recompiles (one compilation per
:class:`_Variant`). The result is within a few ulps
of the eager step, not its bytes: the compiler may contract a multiply and an add into an FMA
where torch's kernels round twice, or the reverse. A moment whose fp32 value moved by an ulp
lands on the neighbouring code where it sits on a threshold between two codes; its
dequantized value then differs by one gap of the map (at most ``2 * max_error * |scale|``).
Codes are still a deterministic function of the moments, and blocks stay on each param's
global index, so checkpoints and resharding keep their bytes. The quantizer's division is
compiled correctly rounded where inductor offers the choice (Triton's ``/`` is approximate;
``eager_numerics.division_rounding``, :func:`~shardkit.optim._torch_compat.inductor_options`),
so equal moments give the eager codec's codes. A short last chunk is padded (param and gradient
with zeros, codes and scales as ``_compact_fused._chunk`` pads them) and copied back; the
kernel sets the padding's new moments to zero before quantizing (a compare with the chunk's
count of real elements, a kernel input, so no recompilation): a padding code in the last real
block would otherwise dequantize to a multiple of that block's scale and could become its
extreme, while zeros move neither extreme of a block that holds a real element. On a GPU a
padded chunk costs little, so unlike [Note: Short tails step eagerly] no tail is left to the
eager step.

[Note: Step scalars without a sync]
The bias corrections depend on each param's step count. torch's single-tensor and foreach Adam
keep it on the CPU, and so does this package then: it is read there, and the scalars of all the
params of a call reach the device in one copy. torch's fused Adam keeps it on the param's
device, where reading it would make the host wait for the device once per param; the scalars
are then computed there, in double precision like torch's host arithmetic, for all the params
of a call at once (a few small kernels per call, none per param), and the host never waits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from shardkit.optim._compact import CompactFormat, CompactTensor, _decode, _encode_rows
from shardkit.optim._compact_fused import (
    FUSED_CHUNK,
    _chunk,
    _compile,
    _copy_back,
    _give_up,
    _state,
    compiled_steppable,
    zero_padded,
)
from shardkit.optim._compact_maps import Tables, lookup_tables
from shardkit.optim._torch_compat import inductor_options, no_function_modes

__all__ = ["KERNEL_DEVICES", "kernel_eligible", "kernel_hypers", "kernel_param_step"]

KERNEL_DEVICES: frozenset[str] = frozenset({"cuda"})
"""Device types whose compact moments step through the one kernel ([Note: One kernel on a
GPU]); on the others (the CPU) the compiled halves of ``_compact_fused.py`` step them."""

# the slots of a row of kernel_hypers
_W1, _B2, _W2, _EPS, _NEG_STEP, _BC2_SQRT, _DECAY, _VALID = range(8)


@dataclass(frozen=True)
class _Variant:
    """What changes the kernel's graph (one compilation each)."""

    formats: tuple[CompactFormat, ...]
    """The moments' formats (2, or 3 with amsgrad)."""
    maximize: bool
    """Whether the gradient is negated."""
    decay: str
    """``""`` (no weight decay), ``"adam"`` (added to the gradient) or ``"adamw"``
    (decoupled: the param scaled first)."""


def kernel_eligible(param: torch.Tensor, grad: torch.Tensor, moments: Sequence[object]) -> bool:
    """Whether the one kernel steps this param: a device of :data:`KERNEL_DEVICES`, and
    ``_compact_fused.compiled_steppable``."""
    return param.device.type in KERNEL_DEVICES and compiled_steppable(param, grad, moments)


def _body(variant: _Variant) -> Callable[..., None]:
    """The kernel of ``variant``, before compilation (see [Note: One kernel on a GPU])."""
    v = variant

    def step_chunk(
        param: torch.Tensor,
        grad: torch.Tensor,
        codes: list[torch.Tensor],
        scales: list[torch.Tensor],
        tables: list[Tables],
        hyper: torch.Tensor,
    ) -> None:
        g = grad.neg() if v.maximize else grad
        p = param
        if v.decay == "adamw":
            p = p * hyper[_DECAY]
        elif v.decay == "adam":
            g = g + hyper[_DECAY] * p
        moments = []
        for k, fmt in enumerate(v.formats):
            out = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            _decode(codes[k], scales[k], tables[k].pairs, fmt.block, out)
            moments.append(out)
        m = torch.lerp(moments[0], g, hyper[_W1])
        sq = moments[1] * hyper[_B2] + (hyper[_W2] * g) * g
        new = [m, sq]
        if len(v.formats) == 3:
            top = torch.maximum(moments[2], sq)
            new.append(top)
            denom = top.sqrt() / hyper[_BC2_SQRT] + hyper[_EPS]
        else:
            denom = sq.sqrt() / hyper[_BC2_SQRT] + hyper[_EPS]
        param.copy_(p + hyper[_NEG_STEP] * (m / denom))
        # See [Note: One kernel on a GPU]: the padding's moments are zero before quantizing
        real = torch.arange(param.numel(), device=param.device, dtype=torch.float32) < hyper[_VALID]
        new = [torch.where(real, x, 0.0) for x in new]
        for k, fmt in enumerate(v.formats):
            _encode_rows(new[k].view(-1, fmt.block), scales[k], codes[k], 0, fmt.qmap, tables[k])

    return step_chunk


@functools.cache
def _compiled(variant: _Variant) -> Callable[..., None]:
    """The variant's kernel (compiled on its first call), made once per process."""
    extra = inductor_options({"eager_numerics.division_rounding": True})
    return _compile(_body(variant), f"compact_step_{abs(hash(variant)):x}", extra)


def kernel_hypers(
    steps: Sequence[torch.Tensor], kwargs: dict[str, Any], device: torch.device
) -> torch.Tensor:
    """The scalars of one step of several params, one fp32 row each (slots ``_W1`` ...
    ``_VALID``) on ``device``: see [Note: Step scalars without a sync].

    Args:
        steps: the params' 0-d step counts before this step (the caller increments them).
        kwargs: the eager step's Adam keywords plus ``decoupled`` (AdamW).
        device: where the kernel runs.
    """
    lr = float(kwargs["lr"])
    beta1, beta2 = float(kwargs["beta1"]), float(kwargs["beta2"])
    wd = float(kwargs["weight_decay"])
    base = [
        1 - beta1,
        beta2,
        1 - beta2,
        float(kwargs["eps"]),
        0.0,  # _NEG_STEP: per param, below
        0.0,  # _BC2_SQRT: per param, below
        1 - lr * wd if kwargs["decoupled"] else wd,
        float(FUSED_CHUNK),  # _VALID: a short last chunk's count is set per call
    ]
    if all(s.device.type == "cpu" for s in steps):
        rows = []
        for s in steps:
            t = float(s.item()) + 1.0  # torch increments the step count before it is used
            row = list(base)
            row[_NEG_STEP] = -(lr / (1 - beta1**t))
            row[_BC2_SQRT] = (1 - beta2**t) ** 0.5
            rows.append(row)
        return torch.tensor(rows, dtype=torch.float32).to(device, non_blocking=True)
    return _hypers_on(steps, base, lr, beta1, beta2, device)


def _hypers_on(
    steps: Sequence[torch.Tensor], base: list[float], lr: float, beta1: float, beta2: float,
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """:func:`kernel_hypers` computed on ``device`` from step counts that may live there."""
    t = torch.stack([s.to(device=device, dtype=torch.float32) for s in steps]).double() + 1.0
    out = torch.empty((len(steps), len(base)), dtype=torch.float64, device=device)
    for k, value in enumerate(base):
        out[:, k].fill_(value)
    out[:, _NEG_STEP] = (1 - torch.pow(beta1, t)).reciprocal_().mul_(-lr)
    out[:, _BC2_SQRT] = (1 - torch.pow(beta2, t)).sqrt_()
    return out.float()


def kernel_param_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: Sequence[CompactTensor],
    hyper: torch.Tensor,
    kwargs: dict[str, Any],
) -> int:
    """Steps one param (flat) with the one kernel, chunk by chunk.

    ``hyper`` is its row of :func:`kernel_hypers`; ``kwargs`` the eager step's Adam keywords
    plus ``decoupled`` (AdamW). Returns how many leading
    elements it stepped: all of them, or, where compilation is unavailable or fails, the chunks
    stepped before (logged once), which the eager step continues from.
    """
    numel = param.numel()
    if _state["unavailable"] is not None or numel == 0:
        return 0
    decay = "" if kwargs["weight_decay"] == 0 else "adamw" if kwargs["decoupled"] else "adam"
    variant = _Variant(tuple(m.fmt for m in moments), bool(kwargs["maximize"]), decay)
    try:
        kernel = _compiled(variant)
    except Exception as exc:  # torch.compile itself refused (no dynamo on this Python, ...)
        _give_up(f"{type(exc).__name__}: {exc}")
        return 0
    device = param.device
    tables = [lookup_tables(m.fmt.map_name, device) for m in moments]
    for lo in range(0, numel, FUSED_CHUNK):
        hi = min(lo + FUSED_CHUNK, numel)
        n = hi - lo
        chunk = _chunk(moments, device, lo, hi)
        p, g = param[lo:hi], grad[lo:hi]
        h = hyper
        if n < FUSED_CHUNK:  # zero padding: see [Note: One kernel on a GPU]
            p = zero_padded("kernel_param", p, FUSED_CHUNK)
            g = zero_padded("kernel_grad", g, FUSED_CHUNK)
            h = hyper.clone()
            h[_VALID] = n
        try:
            with no_function_modes():  # See [Note: Compiled step, same bytes]
                kernel(p, g, chunk.codes, chunk.scales, tables, h)
        except Exception as exc:  # compiling failed (no Triton, ...): this chunk untouched
            _give_up(f"{type(exc).__name__}: {exc}")
            return lo
        if n < FUSED_CHUNK:
            param[lo:hi].copy_(p[:n])
            _copy_back(chunk, moments, lo, hi)
    return numel
