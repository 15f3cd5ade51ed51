"""The compact Adam / AdamW step with compiled kernels per chunk (issue 51).

:func:`fused_param_step` steps a param whose moments are all compact, :data:`FUSED_CHUNK`
elements at a time: one ``torch.compile``-d kernel dequantizes the moments, torch's own
functional Adam steps the chunk on that fp32 scratch, and a second compiled kernel quantizes
the moments back; see [Note: Compiled step, same bytes]. It replaces the eager codec's dozen
passes per moment and per-chunk dispatch; torch's Adam itself runs as in the eager step.

[Note: Compiled step, same bytes]
The compiled step gives the bytes of the eager step (``_compact_step.py``) with the same
``impl`` (single-tensor, foreach or fused), for every option and every element, NaN, inf,
signed zeros and subnormals included, on the CPU. What makes that so:

* the update is torch's own: the chunk's Adam / AdamW runs through the same functional call as
  in the eager step (same kwargs, same per-item step-count copy), on the same element ranges:
  chunks are cut at multiples of :data:`FUSED_CHUNK` (the eager step cuts at multiples of its
  chunk, a multiple of 256: either way every cut but a param's end is a multiple of every
  vector width), and a last, shorter chunk is stepped on exactly its elements, so torch's
  vector body and scalar tail (which differ for the fused kernel: [Note: Fused steps of cut
  params] in ``_shard_stepper.py``) fall on the same elements as in the eager step. torch's CPU
  ops that round differently from inductor's C++ (``lerp``, ``add(alpha=)`` and ``addcmul`` use
  an FMA, ``sqrt`` is MKL's vector square root, not always correctly rounded) so never run
  compiled;
* the compiled kernels run the eager step's own functions (``_compact._decode`` and
  ``_encode_rows``: ``map[code] * scale``; block extremes, one division, integer ops, a table
  lookup), and inductor's C++ is compiled with ``-ffp-contract=off`` and without unsafe math
  (:data:`COMPILE_OPTIONS`, pinned explicitly): the C++ compiler may neither contract a
  multiply and an add into an FMA nor reorder;
* the kernels see one shape (``dynamic=False``): every chunk is :data:`FUSED_CHUNK` elements,
  a shorter one padded; the padding's moments are set to zero before the quantization (zeros
  change neither the signed extreme nor the absmax of the last block, which holds a real
  element) and its results are dropped. That zeroing runs eagerly, on short chunks only, so
  the quantize kernel carries no mask (a mask in it cost 1.4 ns per element, a quarter of
  the kernel). Nothing that changes per step (learning rate, step count) is a constant of
  the kernels, so a step never recompiles: one compilation per variant
  (:class:`_Variant`: the moments' formats, so amsgrad too), once per
  process (inductor's on-disk cache makes later processes cheaper). The kernels run with the
  torch-function mode stack set aside (``_torch_compat.no_function_modes``): a mode would be
  traced into the graph and its state guarded, which recompiles when that state changes.

[Note: Short tails step eagerly]
A padded chunk costs the compiled kernels a whole chunk's time, however few of its elements
are real, while the eager step's time grows with the elements it steps: on a CPU the two meet
at about half a chunk (the optim README has the figures). So the compiled step stops before a
last chunk shorter than :data:`EAGER_BELOW` (and leaves a param shorter than that to the eager
step whole), and returns where it stopped; the eager step continues from there (the same
hand-over as after a failed compilation), the tails of all the params of the call in a few
batches. The bytes do not change: the eager step
is the compiled step's reference, element for element, and the tail is stepped on exactly its
elements either way. A ZeRO-2 shard ends most params with such a tail (a rank's piece of a
bucket rarely ends on a chunk boundary), so this saves a padded chunk per param.

Transient memory: fp32 scratch of :data:`FUSED_CHUNK` elements for each moment, 1 MiB each,
allocated once per thread and device, plus padded copies for the last chunk of a param.
``tests/test_compact_fused.py`` checks the bytes against the eager step for every option, edge
shapes and specials, and that a second step does not compile again.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from shardkit.optim._compact import CompactFormat, CompactTensor, _decode, _encode_rows
from shardkit.optim._compact_maps import Tables, lookup_tables
from shardkit.optim._torch_compat import no_function_modes

__all__ = [
    "COMPILE_OPTIONS",
    "EAGER_BELOW",
    "FUSED_CHUNK",
    "compiled_steppable",
    "compiled_unavailable",
    "fused_eligible",
    "fused_param_step",
    "zero_padded",
]

logger = logging.getLogger("shardkit.optim")

FUSED_CHUNK = 256 * 1024
"""Elements per call of the compiled kernels (a multiple of every block size)."""

EAGER_BELOW = FUSED_CHUNK // 2
"""A param's last chunk (or a whole param) shorter than this is left to the eager step: see
[Note: Short tails step eagerly]."""

COMPILE_OPTIONS: dict[str, Any] = {
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.enable_unsafe_math_opt_flag": False,
    # the kernels' table indices are in range by construction (a uint8 code into a 256-row
    # table, a 16-bit cell into a 65536-entry one): no bounds check per element
    "assert_indirect_indexing": False,
}
"""inductor options of the compiled kernels: see [Note: Compiled step, same bytes]."""


@dataclass(frozen=True)
class _Variant:
    """What changes the compiled kernels' graphs (one compilation each)."""

    formats: tuple[CompactFormat, ...]
    """The moments' formats (2, or 3 with amsgrad)."""


def _bodies(variant: _Variant) -> tuple[Callable[..., None], Callable[..., None]]:
    """The dequantize and quantize kernels of ``variant``, before compilation."""
    v = variant

    def dequantize(
        codes: list[torch.Tensor],
        scales: list[torch.Tensor],
        tables: list[Tables],
        out: list[torch.Tensor],
    ) -> None:
        for k, fmt in enumerate(v.formats):
            _decode(codes[k], scales[k], tables[k].pairs, fmt.block, out[k])

    def quantize(
        new: list[torch.Tensor],
        tables: list[Tables],
        codes: list[torch.Tensor],
        scales: list[torch.Tensor],
    ) -> None:
        # a short chunk's padding is zero here: see [Note: Compiled step, same bytes]
        for k, fmt in enumerate(v.formats):
            _encode_rows(new[k].view(-1, fmt.block), scales[k], codes[k], 0, fmt.qmap, tables[k])

    return dequantize, quantize


def _compile(
    fn: Callable[..., None], name: str, extra: dict[str, Any] | None = None
) -> Callable[..., None]:
    """``fn`` compiled (on its first call) with :data:`COMPILE_OPTIONS` and ``extra``."""
    # Each variant gets its own code object, so that torch's per-code recompilation limit
    # counts variants separately (a distinct function to dynamo, not a recompilation).
    code = fn.__code__.replace(co_name=name)
    fresh = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    compiled: Callable[..., None] = torch.compile(
        fresh, dynamic=False, fullgraph=True, options={**COMPILE_OPTIONS, **(extra or {})}
    )
    return compiled


@functools.cache
def _compiled(variant: _Variant) -> tuple[Callable[..., None], Callable[..., None]]:
    """The variant's two kernels (compiled on their first call), made once per process."""
    dequantize, quantize = _bodies(variant)
    tag = f"{abs(hash(variant)):x}"
    return (
        _compile(dequantize, f"compact_dequantize_{tag}"),
        _compile(quantize, f"compact_quantize_{tag}"),
    )


_state: dict[str, str | None] = {"unavailable": None}


def compiled_unavailable() -> str | None:
    """Why the compiled step is off for the rest of the process (``None``: it is not)."""
    return _state["unavailable"]


def _give_up(reason: str) -> None:
    if _state["unavailable"] is None:
        _state["unavailable"] = reason
        logger.warning(
            "compact_state: the compiled step is unavailable (%s); the eager step runs instead "
            "for the rest of the process (the reference step: slower; logged once)",
            reason,
        )


_SCRATCH = threading.local()


def _scratch(role: str, dtype: torch.dtype, n: int, device: torch.device) -> torch.Tensor:
    """A buffer of this thread's (reused by every step on the thread: a step runs one chunk
    at a time; optimizers stepped on other threads, e.g. from a comm hook, get their own)."""
    buffers: dict[tuple[str, torch.dtype, int, torch.device], torch.Tensor]
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    key = (role, dtype, n, device)
    buf = buffers.get(key)
    if buf is None:
        buf = buffers[key] = torch.empty(n, dtype=dtype, device=device)
    return buf


def _code_range(fmt: CompactFormat, lo: int, hi: int) -> slice:
    return slice(lo, hi) if fmt.bits == 8 else slice(lo // 2, (hi + 1) // 2)


def fused_eligible(param: torch.Tensor, grad: torch.Tensor, moments: Sequence[object]) -> bool:
    """Whether the compiled step can step this param (else the eager step does): CPU, and
    :func:`compiled_steppable`."""
    return param.device.type == "cpu" and compiled_steppable(param, grad, moments)


def compiled_steppable(param: torch.Tensor, grad: torch.Tensor, moments: Sequence[object]) -> bool:
    """Every moment compact, contiguous tensors, an fp32 gradient: what any compiled step
    needs, whatever the device (a compact moment's param is fp32: ``_compact_step``
    checks it)."""
    if not all(isinstance(m, CompactTensor) for m in moments):
        return False
    return grad.dtype == torch.float32 and grad.is_contiguous() and param.is_contiguous()


@dataclass(frozen=True)
class _Chunk:
    """The tensors of one chunk, as the kernels see them (views, or padded copies)."""

    codes: list[torch.Tensor]
    scales: list[torch.Tensor]


def fused_param_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: Sequence[CompactTensor],
    step: torch.Tensor,
    step_copy: torch.Tensor,
    functional: Callable[..., None],
    kwargs: dict[str, Any],
) -> int:
    """Steps one param (flat) with the compiled kernels, chunk by chunk.

    ``functional`` and ``kwargs`` are the eager step's torch Adam call; ``step_copy`` a 0-d
    tensor on ``step``'s device that each chunk's call increments from ``step``. Returns how
    many leading elements it stepped, which the eager step continues from: all of them; all
    but a short last chunk ([Note: Short tails step eagerly]); or, where compilation is
    unavailable or fails, the chunks stepped before (0 at first; logged once); see [Note:
    Compiled step, same bytes].
    """
    numel = param.numel()
    tail = numel % FUSED_CHUNK
    stop = numel - tail if tail < EAGER_BELOW else numel  # See [Note: Short tails step eagerly]
    if _state["unavailable"] is not None or stop == 0:
        return 0
    variant = _Variant(tuple(m.fmt for m in moments))
    try:
        dequantize, quantize = _compiled(variant)
    except Exception as exc:  # torch.compile itself refused (no dynamo on this Python, ...)
        _give_up(f"{type(exc).__name__}: {exc}")
        return 0
    device = param.device
    tables = [lookup_tables(m.fmt.map_name, device) for m in moments]
    new = [_scratch(f"new{k}", torch.float32, FUSED_CHUNK, device) for k in range(len(moments))]
    for lo in range(0, stop, FUSED_CHUNK):
        hi = min(lo + FUSED_CHUNK, numel)
        n = hi - lo
        chunk = _chunk(moments, device, lo, hi)
        try:
            with no_function_modes():  # See [Note: Compiled step, same bytes]
                dequantize(chunk.codes, chunk.scales, tables, new)
        except Exception as exc:  # compiling failed (no C++ compiler, ...): this chunk untouched
            _give_up(f"{type(exc).__name__}: {exc}")
            return lo
        step_copy.copy_(step)
        functional(
            [param[lo:hi]], [grad[lo:hi]], [new[0][:n]], [new[1][:n]],
            [new[2][:n]] if len(new) > 2 else [], [step_copy], has_complex=False, **kwargs,
        )  # fmt: skip
        if n < FUSED_CHUNK:  # the padding must not move the last block's scale
            for scratch in new:
                scratch[n:].zero_()
        try:
            with no_function_modes():
                quantize(new, tables, chunk.codes, chunk.scales)
        except Exception as exc:  # compiling failed: this chunk ends as the eager step does
            _give_up(f"{type(exc).__name__}: {exc}")
            for k, m in enumerate(moments):
                m.quantize_range_(lo, new[k][:n])
            return hi
        if n < FUSED_CHUNK:
            _copy_back(chunk, moments, lo, hi)
    return stop


def _chunk(moments: Sequence[CompactTensor], device: torch.device, lo: int, hi: int) -> _Chunk:
    """Views of chunk ``[lo, hi)``, or zero-padded copies when it is short."""
    n = hi - lo
    codes = [m.codes[_code_range(m.fmt, lo, hi)] for m in moments]
    scales = [m.scales[lo // m.fmt.block : -(-hi // m.fmt.block)] for m in moments]
    full = n == FUSED_CHUNK

    def padded(role: str, src: torch.Tensor, size: int) -> torch.Tensor:
        return src if full else zero_padded(role, src, size)

    codes = [
        padded(f"codes{k}", c, FUSED_CHUNK * m.fmt.bits // 8)
        for k, (c, m) in enumerate(zip(codes, moments, strict=True))
    ]
    scales = [
        padded(f"scales{k}", s, FUSED_CHUNK // m.fmt.block)
        for k, (s, m) in enumerate(zip(scales, moments, strict=True))
    ]
    return _Chunk(codes, scales)


def zero_padded(role: str, src: torch.Tensor, size: int) -> torch.Tensor:
    """``src`` (flat) copied into this thread's ``role`` buffer of ``size`` elements, the rest
    zero (finite: see [Note: Compiled step, same bytes])."""
    buf = _scratch(role, src.dtype, size, src.device)
    buf[src.numel() :].zero_()
    buf[: src.numel()].copy_(src)
    return buf


def _copy_back(chunk: _Chunk, moments: Sequence[CompactTensor], lo: int, hi: int) -> None:
    """A short chunk's results, from its padded copies into the state."""
    n = hi - lo
    for k, m in enumerate(moments):
        dst = m.codes[_code_range(m.fmt, lo, hi)]
        dst.copy_(chunk.codes[k][: dst.numel()])
        if m.fmt.bits == 4 and n % 2:  # a lone last element keeps its low nibble 0
            dst[-1:].bitwise_and_(0xF0)
        sdst = m.scales[lo // m.fmt.block : -(-hi // m.fmt.block)]
        sdst.copy_(chunk.scales[k][: sdst.numel()])
