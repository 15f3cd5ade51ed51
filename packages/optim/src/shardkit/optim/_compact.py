"""Block-wise quantized tensors: the storage of compact optimizer state (issue 40, engine core).

A :class:`CompactTensor` holds one moment of one param (or of a block-aligned piece of it) as
uint8 *codes* (one per element for 8-bit maps, two per byte for 4-bit ones) and one fp32
*scale* per block; element ``i`` dequantizes to ``map[code[i]] * scale[i // block]``. The maps
are in ``_compact_maps.py``; :data:`FORMATS` says which moment uses which (torchao's
``AdamW8bit`` / ``AdamW4bit`` choices, block 256 / 128). It is plain data, not a tensor
subclass: the step (``_compact_step.py``) dequantizes a chunk into fp32 scratch, steps it with
torch's own Adam, and quantizes it back.

[Note: Blocks on the global flat index]
Element ``i`` of a param (row-major flat index of the *whole* param) belongs to block
``i // block`` of that param, whoever holds it. A rank holding the piece ``[lo, hi)`` of a param
must hold whole blocks: ``lo % block == 0`` and ``hi % block == 0 or hi == numel`` (see
:func:`align_cut`, :func:`check_range`). Then the piece's codes and scales are exactly the
slices ``[lo, hi)`` of the whole param's (:meth:`CompactTensor.narrow`), quantizing pieces
separately gives the bits of quantizing the whole, and any other aligned cut (a reshard N -> M)
is a slice and a concatenation of bytes: exact by construction. Whether a param is compact at
all is decided on its global size too (:func:`stores_compact`), never on a shard's.

[Note: Signed scale]
torchao and bitsandbytes scale a block by its absmax; the signed maps reach ``+1`` but not
``-1`` (their lowest value is ``-0.99297`` for 8 bits, ``-0.8875`` for 4 bits), so a block
whose largest magnitude is negative loses 0.7 % (11.25 % at 4 bits) on it, and requantizing
the dequantized block shrinks its scale again: quantize after dequantize is not the identity.
Here a signed map's scale is the block's *signed* extreme: the element of largest magnitude
(the positive one on a tie) divided by the scale is exactly ``+1``, a code of every map, so it
round trips exactly, the rest of the block uses the map mirrored when the scale is negative,
and requantizing a dequantized block finds the same scale (its extreme is ``1.0 * scale``) and
the same codes. Unsigned maps (the second moment, never negative) scale by the absmax; a
negative input to them quantizes to their lowest code.

[Note: Non-finite and tiny blocks]
* A block holding an inf or a NaN is *poisoned*: its scale is NaN and its codes are the zero
  code, so every element of the block dequantizes to NaN. fp32 Adam makes a param NaN where a
  gradient was inf or NaN; compact Adam does the same at that step (the step runs on fp32
  scratch), and stores the moments of that element's whole block as NaN, so the block's params
  are NaN from the next step on. Nothing raises and nothing synchronises (the check would cost
  a device sync per chunk); a loss scaler skips such steps before they get here.
* A block whose largest magnitude is below ``2**-126`` (the smallest normal fp32; zero blocks
  included) is flushed: scale 0, zero codes, dequantizes to exact zeros (error < ``2**-126``).
  With normal scales every dequantized value is exact to fp32 rounding and requantizing it
  gives the same code (the smallest half gap of the maps, ``1.6e-7``, exceeds the rounding,
  ``2**-23``), so :meth:`CompactTensor.quantize_` after :meth:`CompactTensor.dequantize` is the
  identity for every input, which subnormal scales would break.

Error bound (tests: ``test_compact_quant.py``): for an element ``x`` of a block with stored
scale ``s`` (finite, nonzero), ``|dequantize - x| <= |s| * (map.max_error + 2**-22)``; the
``2**-22`` covers the fp32 rounding of ``x / s`` and of ``code * s``. ``max_error`` is half the
map's largest gap (domain ends included): ``0.00703`` / ``0.00352`` (8-bit signed / unsigned),
``0.1125`` / ``0.0625`` (4-bit).

[Note: Bounded transient memory]
:meth:`CompactTensor.quantize_` and :meth:`CompactTensor.dequantize` work :data:`CHUNK`
elements (a multiple of every block size) at a time: the full-precision temporaries (the fp32
copy of a low-precision source, ``x / s``, its bit view, two table lookups, the codes before
packing) exist for one chunk only, never for the whole tensor. Measured by
``test_compact_quant.py::test_transient_memory_is_one_chunk`` (a dispatch mode that tracks live
tensor storages): at most ``TRANSIENT_BYTES_PER_ELEMENT * CHUNK`` bytes (1.06 MiB), whatever the
tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from shardkit.optim._compact_maps import MAPS, QuantMap, Tables, lookup_tables

__all__ = [
    "CHUNK",
    "COMPACT_MIN_NUMEL",
    "FORMATS",
    "TRANSIENT_BYTES_PER_ELEMENT",
    "CompactFormat",
    "CompactTensor",
    "align_cut",
    "check_range",
    "compact_formats",
    "moment_formats",
    "stores_compact",
]

CHUNK = 64 * 1024
"""Elements quantized or dequantized at a time (a multiple of every block size)."""

TRANSIENT_BYTES_PER_ELEMENT = 17
"""Bound on the live temporaries of one chunk, in bytes per chunk element, which
``tests/test_compact_quant.py`` holds the quantizer to (the optim README has the measured
figures; see [Note: Bounded transient memory])."""

COMPACT_MIN_NUMEL = 4096
"""Params with fewer elements keep full-precision state (bitsandbytes' ``min_8bit_size``)."""

_TINY = 2.0**-126  # smallest normal fp32: see [Note: Non-finite and tiny blocks]
_COMPACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CompactFormat:
    """How one moment is stored."""

    map_name: str
    """A key of ``_compact_maps.MAPS``: which value each code stands for."""
    block: int
    """Elements per block (one fp32 scale each); even, and a divisor of :data:`CHUNK`."""

    def __post_init__(self) -> None:
        if self.map_name not in MAPS:
            raise ValueError(
                f"unknown quantization map {self.map_name!r}; expected one of {sorted(MAPS)}"
            )
        if (
            not isinstance(self.block, int)
            or self.block < 2
            or self.block % 2
            or CHUNK % self.block
        ):
            raise ValueError(
                f"block must be an even divisor of {CHUNK} (e.g. 256 or 128), got {self.block!r}"
            )

    @property
    def qmap(self) -> QuantMap:
        """The map."""
        return MAPS[self.map_name]

    @property
    def bits(self) -> int:
        """Bits per code: 8 or 4."""
        return self.qmap.bits


FORMATS: dict[str, tuple[CompactFormat, CompactFormat]] = {
    "int8": (CompactFormat("dynamic-signed-8", 256), CompactFormat("dynamic-unsigned-8", 256)),
    "int4": (CompactFormat("dynamic-signed-4", 128), CompactFormat("linear-nozero-4", 128)),
}
"""``kind -> (first-moment format, second-moment format)``, as torchao's ``AdamW8bit`` and
``AdamW4bit`` store them (``max_exp_avg_sq`` uses the second moment's)."""


def moment_formats(kind: str) -> tuple[CompactFormat, CompactFormat]:
    """The (first, second) moment formats of ``kind`` (``"int8"`` or ``"int4"``)."""
    try:
        return FORMATS[kind]
    except (KeyError, TypeError):
        raise ValueError(
            f"compact state kind must be one of {sorted(FORMATS)}, got "
            f"{type(kind).__name__}: {kind!r}"
        ) from None


def stores_compact(numel: int, dtype: torch.dtype, min_numel: int = COMPACT_MIN_NUMEL) -> bool:
    """Whether a param's moments are stored compact: decided on its *global* size and dtype.

    Floating params of fp32, bf16 or fp16 with at least ``min_numel`` elements are; smaller
    ones (biases, norms: under 0.5 % of a transformer's elements, and the params whose
    moments quantize worst), complex, fp64 and integer ones keep full precision. The default
    4096 is bitsandbytes' ``min_8bit_size`` (torchao also requires 4096, plus a multiple of the
    block, which blocks on the global index do not need: see [Note: Blocks on the global
    flat index]).
    """
    return numel >= min_numel and dtype in _COMPACT_DTYPES


# [Note: One compact decider]
# Which tensors keep compact moments, in which formats, is decided in one place for ZeRO-1's
# wrapped optimizer, ZeRO-2's stepper and its bucket layout, the construction check and the
# loads: :func:`compact_formats` of the optimizer's ``compact_state``, the param's *global* size
# (:func:`stores_compact`: the same at every world size, [Note: Blocks on the global flat
# index]), its dtype, and the dtype of the value stepped for it when known (compact moments step
# fp32 values: the param, or its fp32 master). The bucket layout asks it without the stepped
# dtype (a bf16 param with an fp32 master is laid out block-aligned); the optimizer asks it with
# the stepped tensor; ``ShardedOptimizer`` refuses, at construction, a low-precision param it
# would make compact without a master, so the two answers agree on every param that trains.
def compact_formats(
    kind: str | None, numel: int, dtype: torch.dtype, stepped: torch.dtype | None = None
) -> tuple[CompactFormat, CompactFormat] | None:
    """The (first, second) moment formats of a param under ``compact_state=kind``, or ``None``
    when its moments keep full precision. See [Note: One compact decider].

    Args:
        kind: The optimizer's ``compact_state`` (``"int8"``, ``"int4"`` or ``None``).
        numel: The param's *global* number of elements (a piece's whole param's).
        dtype: The param's dtype.
        stepped: The dtype of the value the optimizer steps for it (the param's, or its
            master's), when known: any other than fp32 keeps full precision.
    """
    if kind is None or not stores_compact(numel, dtype):
        return None
    if stepped is not None and stepped != torch.float32:
        return None
    return moment_formats(kind)


def _check_int(name: str, value: object, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {type(value).__name__}: {value!r}")
    return value


def align_cut(numel: int, cut: int, block: int) -> int:
    """The block-aligned cut nearest to ``cut`` in a param of ``numel`` elements.

    Aligned cuts are the multiples of ``block`` and ``numel`` itself; a tie goes to the lower
    one. A layout cuts each compact param only there (see [Note: Blocks on the global flat
    index]).
    """
    _check_int("numel", numel)
    _check_int("block", block, 1)
    if not isinstance(cut, int) or isinstance(cut, bool) or not 0 <= cut <= numel:
        raise ValueError(
            f"cut must be an int in [0, {numel}] (the param's numel), got "
            f"{type(cut).__name__}: {cut!r}"
        )
    down = cut - cut % block
    up = min(down + block, numel)
    return down if cut - down <= up - cut else up


def check_range(numel: int, lo: int, hi: int, block: int) -> None:
    """Raises ``ValueError`` unless ``[lo, hi)`` is a block-aligned range of a ``numel`` param."""
    if not (0 <= lo <= hi <= numel) or any(c % block and c != numel for c in (lo, hi)):
        raise ValueError(
            f"element range [{lo}, {hi}) of a {numel}-element compact tensor must hold whole "
            f"blocks of {block}: start and end multiples of {block} or {numel}. Cut compact "
            f"params at align_cut() positions."
        )


def _code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def _code_slice(lo: int, hi: int, bits: int) -> slice:
    # lo is even unless lo == hi == numel (an empty range at the end)
    return slice(lo, hi) if bits == 8 else slice((lo + 1) // 2, (hi + 1) // 2)


def _scale_slice(lo: int, hi: int, block: int) -> slice:
    return slice(-(-lo // block), -(-hi // block))


@dataclass(frozen=True, eq=False)
class CompactTensor:
    """A tensor stored as block-wise quantized codes and scales (plain data, no subclass).

    The container is immutable; :meth:`quantize_` rewrites its ``codes`` and ``scales`` in
    place. Build with :meth:`zeros` or :meth:`from_tensor`.
    """

    codes: torch.Tensor
    """uint8, 1-D: element ``i``'s code at byte ``i`` (8-bit) or in the high (even ``i``) or
    low (odd ``i``) nibble of byte ``i // 2`` (4-bit; a lone last element's low nibble is 0)."""
    scales: torch.Tensor
    """fp32, 1-D, one per block: see [Note: Signed scale] and [Note: Non-finite and tiny
    blocks]."""
    shape: tuple[int, ...]
    """Shape of the tensor it stands for (a param's, or ``(hi - lo,)`` for a piece)."""
    fmt: CompactFormat
    """Map and block size."""

    def __post_init__(self) -> None:
        if not isinstance(self.fmt, CompactFormat):
            raise TypeError(f"fmt must be a CompactFormat, got {type(self.fmt).__name__}")
        n = self.numel
        want = {
            "codes": (torch.uint8, _code_bytes(n, self.fmt.bits)),
            "scales": (torch.float32, -(-n // self.fmt.block)),
        }
        for name, (dtype, size) in want.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
                raise TypeError(
                    f"CompactTensor.{name} must be a 1-D {dtype} tensor, got "
                    f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}"
                )
            if t.numel() != size or not t.is_contiguous():
                raise ValueError(
                    f"CompactTensor.{name} of a {n}-element {self.fmt.map_name} tensor with "
                    f"blocks of {self.fmt.block} must be contiguous with {size} elements, got "
                    f"{t.numel()}"
                )
        if self.codes.device != self.scales.device:
            raise ValueError(
                f"codes and scales must share a device, got {self.codes.device} and "
                f"{self.scales.device}"
            )

    # ---------------------------------------------------------------- construction

    @classmethod
    def zeros(
        cls, shape: Sequence[int], fmt: CompactFormat, device: torch.device | str | None = None
    ) -> CompactTensor:
        """A compact tensor of zeros (what ``torch.zeros`` is to a moment's first step)."""
        shape = tuple(int(d) for d in shape)
        n = math.prod(shape)
        z = fmt.qmap.zero_code
        fill = z if fmt.bits == 8 else (z << 4) | z
        codes = torch.full((_code_bytes(n, fmt.bits),), fill, dtype=torch.uint8, device=device)
        scales = torch.zeros(-(-n // fmt.block), dtype=torch.float32, device=device)
        if fmt.bits == 4 and n % 2:
            codes[-1:] = z << 4
        return cls(codes, scales, shape, fmt)

    @classmethod
    def from_tensor(
        cls, src: torch.Tensor, fmt: CompactFormat, chunk: int = CHUNK
    ) -> CompactTensor:
        """Quantizes ``src`` (any floating dtype, contiguous) into a new compact tensor."""
        out = cls.zeros(tuple(src.shape), fmt, src.device)
        return out.quantize_(src, chunk)

    # ---------------------------------------------------------------- properties

    @property
    def numel(self) -> int:
        """Elements it stands for."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of its codes and scales."""
        return self.codes.numel() + 4 * self.scales.numel()

    @property
    def device(self) -> torch.device:
        """Device of codes and scales."""
        return self.codes.device

    # ---------------------------------------------------------------- whole-tensor ops

    def _chunks(self, chunk: int) -> range:
        if not isinstance(chunk, int) or chunk <= 0 or chunk % self.fmt.block:
            raise ValueError(
                f"chunk must be a positive multiple of the block ({self.fmt.block}), got {chunk!r}"
            )
        return range(0, self.numel, chunk)

    def _flat(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(
                f"{what} must be a floating tensor, got {type(t).__name__} "
                f"{getattr(t, 'dtype', '')}"
            )
        if t.numel() != self.numel or not t.is_contiguous() or t.device != self.device:
            raise ValueError(
                f"{what} must be a contiguous tensor of {self.numel} elements on {self.device}, "
                f"got shape {tuple(t.shape)} on {t.device}"
                + ("" if t.is_contiguous() else " (not contiguous: pass .contiguous())")
            )
        return t.view(-1)

    def quantize_(self, src: torch.Tensor, chunk: int = CHUNK) -> CompactTensor:
        """Stores ``src`` (floating, contiguous, ``numel`` elements), one chunk at a time.

        Returns ``self``. See [Note: Bounded transient memory].
        """
        flat = self._flat(src, "the source")
        for lo in self._chunks(chunk):
            self.quantize_range_(lo, flat[lo : lo + chunk])
        return self

    def dequantize(
        self,
        out: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        chunk: int = CHUNK,
    ) -> torch.Tensor:
        """The values it stands for, in ``out`` (floating, contiguous) or a new ``dtype`` tensor.

        Values are computed in fp32 (``map[code] * scale``) and cast to ``out``'s dtype.
        """
        if out is None:
            out = torch.empty(self.shape, dtype=dtype, device=self.device)
        flat = self._flat(out, "out")
        for lo in self._chunks(chunk):
            hi = min(lo + chunk, self.numel)
            self.dequantize_range(lo, hi, flat[lo:hi])
        return out

    # ---------------------------------------------------------------- ranges (the step's API)

    def quantize_range_(self, lo: int, src: torch.Tensor) -> None:
        """Stores ``src`` (flat, floating) as elements ``[lo, lo + src.numel())``.

        The range must hold whole blocks (see [Note: Blocks on the global flat index]); its
        temporaries are a few times ``src``'s size, so callers pass at most a chunk.
        """
        n, block, bits = src.numel(), self.fmt.block, self.fmt.bits
        check_range(self.numel, lo, lo + n, block)
        x = src.reshape(-1)
        if x.dtype != torch.float32:
            x = x.float()
        codes = self.codes[_code_slice(lo, lo + n, bits)]
        scales = self.scales[_scale_slice(lo, lo + n, block)]
        qmap, tables = self.fmt.qmap, lookup_tables(self.fmt.map_name, self.device)
        full = n // block * block
        if full:
            _encode_rows(x[:full].view(-1, block), scales[: full // block], codes, 0, qmap, tables)
        if n > full:
            _encode_rows(x[full:].view(1, -1), scales[-1:], codes, full, qmap, tables)

    def dequantize_range(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Writes elements ``[lo, hi)`` (whole blocks) into ``out`` (flat, floating)."""
        block, bits = self.fmt.block, self.fmt.bits
        check_range(self.numel, lo, hi, block)
        n = hi - lo
        if out.numel() != n:
            raise ValueError(
                f"out must have {n} elements for the range [{lo}, {hi}), got {out.numel()}"
            )
        codes = self.codes[_code_slice(lo, hi, bits)]
        scales = self.scales[_scale_slice(lo, hi, block)]
        pairs = lookup_tables(self.fmt.map_name, self.device).pairs
        _decode(codes, scales, pairs, block, out.reshape(-1))

    def narrow(self, lo: int, hi: int) -> CompactTensor:
        """Elements ``[lo, hi)`` (whole blocks) as a flat compact tensor sharing storage."""
        check_range(self.numel, lo, hi, self.fmt.block)
        return CompactTensor(
            self.codes[_code_slice(lo, hi, self.fmt.bits)],
            self.scales[_scale_slice(lo, hi, self.fmt.block)],
            (hi - lo,),
            self.fmt,
        )

    @staticmethod
    def cat(pieces: Sequence[CompactTensor], shape: Sequence[int] | None = None) -> CompactTensor:
        """Consecutive pieces of one tensor as one (copies); ``shape`` defaults to flat.

        Every piece but the last must hold whole blocks, and all share one format.
        """
        if not pieces:
            raise ValueError("cat needs at least one piece")
        fmt = pieces[0].fmt
        for i, p in enumerate(pieces):
            if p.fmt != fmt:
                raise ValueError(f"piece {i} has format {p.fmt}, piece 0 has {fmt}")
            if i < len(pieces) - 1 and p.numel % fmt.block:
                raise ValueError(
                    f"piece {i} has {p.numel} elements, not a multiple of the block "
                    f"({fmt.block}): only the last piece may end inside a block"
                )
        n = sum(p.numel for p in pieces)
        out_shape = (n,) if shape is None else tuple(int(d) for d in shape)
        if math.prod(out_shape) != n:
            raise ValueError(f"shape {out_shape} does not hold the pieces' {n} elements")
        return CompactTensor(
            torch.cat([p.codes for p in pieces]),
            torch.cat([p.scales for p in pieces]),
            out_shape,
            fmt,
        )

    def clone(self) -> CompactTensor:
        """A copy with its own storage."""
        return CompactTensor(self.codes.clone(), self.scales.clone(), self.shape, self.fmt)

    def equal(self, other: CompactTensor) -> bool:
        """Same format, shape, codes and scale bits (NaN scales compare by bits)."""
        return (
            self.fmt == other.fmt
            and self.shape == other.shape
            and torch.equal(self.codes, other.codes)
            and torch.equal(self.scales.view(torch.int32), other.scales.view(torch.int32))
        )


def _decode(
    codes: torch.Tensor, scales: torch.Tensor, pairs: torch.Tensor, block: int, dst: torch.Tensor
) -> None:
    """``dst[i] = map[code i] * scale[i // block]`` (``pairs``: the map by byte, see ``Tables``).

    A pure function of tensors, like :func:`_encode_rows`: both compile with ``torch.compile``
    to bit-identical results (``benchmarks/bench_compact.py`` measures it).
    """
    n = dst.numel()
    values = pairs.index_select(0, codes.to(torch.int32)).view(-1)[:n]
    full = n // block * block
    for a, b, s in ((0, full, scales[: full // block]), (full, n, scales[full // block :])):
        if a == b:
            continue
        rows = values[a:b].view(s.numel(), -1)
        if dst.dtype == torch.float32:
            torch.mul(rows, s[:, None], out=dst[a:b].view(s.numel(), -1))
        else:
            dst[a:b].view(s.numel(), -1).copy_(rows * s[:, None])


def _encode_rows(
    x: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    start: int,
    qmap: QuantMap,
    tables: Tables,
) -> None:
    """Quantizes the rows (blocks) of ``x`` into ``scales`` and ``codes`` from element ``start``.

    See [Note: Signed scale], [Note: Non-finite and tiny blocks] and, in ``_compact_maps.py``,
    [Note: Nearest code by table].
    """
    hi, lo = x.amax(1), x.amin(1)
    s = torch.where(hi >= -lo, hi, lo) if qmap.signed else torch.maximum(hi, -lo)
    ok = (s.abs() >= _TINY) & torch.isfinite(s)
    scales.copy_(torch.where(ok, s, torch.where(torch.isnan(s) | torch.isinf(s), torch.nan, 0.0)))
    r = x / torch.where(ok, s, 1.0)[:, None]
    bits = r.view(torch.int32)
    key = (bits >> 31).bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)
    del r, bits
    cell = (key >> 16).bitwise_and_(0xFFFF).view(-1)
    code = tables.entry.index_select(0, cell)
    del cell
    code.add_(key.bitwise_and_(0xFFFF).view(-1)).bitwise_right_shift_(16)
    del key
    code.view(x.shape).masked_fill_(~ok[:, None], qmap.zero_code)
    n = code.numel()
    if qmap.bits == 8:
        codes[start : start + n].copy_(code)
        return
    even = n - n % 2
    pairs = code[:even].view(-1, 2)
    dst = codes[start // 2 : start // 2 + even // 2]
    dst.copy_((pairs[:, 0] << 4).bitwise_or_(pairs[:, 1]))
    if n % 2:
        codes[start // 2 + even // 2 : start // 2 + even // 2 + 1] = code[-1:] << 4
