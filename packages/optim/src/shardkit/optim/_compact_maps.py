"""The code books of compact optimizer state: which fp32 value each 8-bit or 4-bit code stands for.

A map is a sorted tuple of fp32 values in ``[-1, 1]`` (signed) or ``[0, 1]`` (unsigned), each
with ``1.0`` at the top; a block of a moment is stored as one fp32 scale and one code per
element, and an element dequantizes to ``map[code] * scale``. The four maps are the anchors'
(torchao's ``AdamW8bit`` / ``AdamW4bit``; bitsandbytes' 8-bit optimizers for the 8-bit ones):

* ``dynamic-signed-8`` (first moment, 8-bit) and ``dynamic-unsigned-8`` (second moment, 8-bit):
  Dettmers' dynamic tree map (Dettmers 2015, "8-Bit Approximations for Parallelism in Deep
  Learning"; Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"), built as
  bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`` builds it:
  for each decade ``10**(i - 6)``, ``i = 0..6``, the midpoints of ``2**i`` (signed, mirrored
  for negatives) or ``2**(i + 1)`` (unsigned) equal steps of ``[0.1, 1]``, plus ``0`` and ``1``.
* ``dynamic-signed-4`` (first moment, 4-bit): the same construction with
  ``max_exponent_bits=3, total_bits=4`` (torchao ``AdamW4bit``; Li et al. 2023, "Memory
  Efficient Optimizers with 4-bit States": dynamic exponent map for the first moment).
* ``linear-nozero-4`` (second moment, 4-bit): ``k / 16`` for ``k = 1..16``, a linear map
  without zero (Li et al. 2023, section 4.1: a second moment quantized to zero turns
  ``m / (sqrt(v) + eps)`` into a huge update; torchao ``AdamW4bit`` uses this map block-wise).

[Note: Exact code books]
The values are computed here in exact rational arithmetic and rounded once to fp32 (round to
nearest, ties to even), so they are the same bits on every machine and torch version: the
codes of a checkpoint mean the same values forever (``tests/test_compact_quant.py`` pins every
map's bits). bitsandbytes and torchao compute the same formula through fp32 ``torch.linspace``
and an fp32 mean, so 72, 100 and 4 of the values of the three dynamic maps differ from theirs
(torchao 0.18) by 1-2 units in the last place (relative ~1e-7); the linear map is identical.

[Note: Nearest code by table]
Quantizing finds, for ``r = x / scale`` in fp32, the nearest code, ties to the larger code
(``r`` exactly half way goes up): the code is the number of *thresholds* ``t_k <= r``, where
``t_k`` is the smallest fp32 ``>=`` the exact midpoint of codes ``k`` and ``k + 1`` (for an
fp32 ``r``, ``r >= t_k`` exactly when ``r`` is at or above the midpoint). A binary search
(``torch.bucketize``) gives that but costs ~50 ns per element on a CPU; instead one table
lookup does. The *key* of an fp32 is its bit pattern as an int32, with the 31 low bits flipped
for negative values (``b ^ ((b >> 31) & 0x7FFFFFFF)``): keys order like the values. The high 16
bits of the key pick a *cell* (a contiguous interval of values, 65536 of them) and the table
entry ``e = base * 65536 + (65536 - t)``, where ``base`` is the code of the cell's lowest value
and ``t`` the low 16 key bits of the one threshold inside the cell (``t = 65536``: none); with
``low`` the low 16 key bits of ``r``, ``code = (e + low) >> 16`` is ``base + (low >= t)``, i.e.
``base + (r >= threshold)``. That is exact when no cell holds two thresholds, which
:func:`lookup_tables` checks when it builds the table (it holds for the four maps: in
``[0.5, 1]``, where the dynamic maps' thresholds are densest, cells are ``2**-8`` wide and
thresholds at least ``0.9 / 128`` apart). Cells of inf and NaN get entry 0; such inputs only
occur in poisoned blocks, whose codes are overwritten (see [Note: Non-finite and tiny blocks]
in ``_compact.py``). Per element: a division, seven integer ops and one gather from a 256 KiB
table; it runs as is on a GPU.
"""

from __future__ import annotations

import functools
import itertools
import struct
from dataclasses import dataclass
from fractions import Fraction

import torch

__all__ = ["MAPS", "QuantMap", "lookup_tables"]


def _fp32_bits(x: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", x))[0])


def _fp32_from_bits(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0])


def _fp32_neighbours(x: float) -> tuple[float, float]:
    """The fp32 values just below and just above the fp32 value ``x`` (finite, nonzero or 0)."""
    if x == 0.0:
        tiny = _fp32_from_bits(1)
        return -tiny, tiny
    bits = _fp32_bits(x)
    step = 1 if x > 0 else -1
    return _fp32_from_bits(bits - step), _fp32_from_bits(bits + step)


def _round_fp32(q: Fraction) -> float:
    """``q`` rounded to the nearest fp32, ties to even (the map values, exactly once)."""
    guess = struct.unpack("<f", struct.pack("<f", float(q)))[0]
    cands = [guess, *_fp32_neighbours(guess)]
    best = min(abs(Fraction(c) - q) for c in cands)
    near = [c for c in cands if abs(Fraction(c) - q) == best]
    near.sort(key=lambda c: _fp32_bits(c) & 1)  # a tie: the even mantissa first
    return float(near[0])


def _ceil_fp32(q: Fraction) -> float:
    """The smallest fp32 ``>= q`` (a threshold: see [Note: Nearest code by table])."""
    c = _round_fp32(q)
    if Fraction(c) < q:
        c = _fp32_neighbours(c)[1]
    return c


def _dynamic_map(signed: bool, max_exponent_bits: int, total_bits: int) -> list[Fraction]:
    """Dettmers' dynamic tree map, as bitsandbytes' ``create_dynamic_map`` defines it.

    The decade ``10**(i - (max_exponent_bits - 1))`` holds the midpoints of ``2**i`` (signed)
    or ``2**(i + 1)`` (unsigned) equal steps of ``[0.1, 1]``; then ``0`` and ``1``.
    """
    non_sign_bits = total_bits - 1
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1
    if extra:  # never for the maps below; the formula would add a linear region
        raise ValueError(f"unsupported dynamic map: {non_sign_bits=} > {max_exponent_bits=}")
    values: list[Fraction] = []
    for i in range(max_exponent_bits):
        steps = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1))
        decade = Fraction(10) ** (i - (max_exponent_bits - 1))
        for j in range(steps):
            # midpoint of [0.1 + 0.9 j / steps, 0.1 + 0.9 (j + 1) / steps]
            mean = Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * j + 1, 2 * steps)
            values.append(decade * mean)
            if signed:
                values.append(-decade * mean)
    values += [Fraction(0), Fraction(1)]
    return sorted(values)


@dataclass(frozen=True)
class QuantMap:
    """One code book (see the module docstring); build with :data:`MAPS`."""

    name: str
    """Stable identifier, stored with the codes (a checkpoint names the map its codes use)."""
    bits: int
    """8 or 4: bits per code."""
    signed: bool
    """Whether the map covers ``[-1, 1]`` (first moment) or only ``[0, 1]`` (second moment)."""
    values: tuple[float, ...]
    """The ``2**bits`` fp32 values, sorted ascending, ``values[-1] == 1.0``."""
    thresholds: tuple[float, ...]
    """``thresholds[k]``: the smallest fp32 ``>=`` the midpoint of ``values[k]`` and
    ``values[k + 1]``; the code of ``r`` is the number of thresholds ``<= r``."""
    zero_code: int
    """The code of ``0.0`` (the nearest value to zero): what empty, flushed and poisoned blocks
    store (see [Note: Non-finite and tiny blocks] in ``_compact.py``)."""
    max_error: float
    """The largest distance from a point of the domain (``[-1, 1]`` or ``[0, 1]``) to its nearest
    value, rounded up to fp32: half the largest gap, the ends of the domain included. A block
    with scale ``s`` then dequantizes within ``|s| * (max_error + 2**-22)`` of its input."""

    @property
    def domain_low(self) -> float:
        """The lowest input (in units of the block scale) the map is meant for."""
        return -1.0 if self.signed else 0.0


def _make_map(name: str, bits: int, signed: bool, exact: list[Fraction]) -> QuantMap:
    if len(exact) != 2**bits or len(set(exact)) != len(exact):
        raise RuntimeError(f"map {name}: {len(exact)} values, expected {2**bits} distinct ones")
    values = tuple(_round_fp32(v) for v in exact)
    fv = [Fraction(v) for v in values]
    thresholds = tuple(_ceil_fp32((a + b) / 2) for a, b in itertools.pairwise(fv))
    low = Fraction(-1) if signed else Fraction(0)
    worst = max(
        [fv[0] - low, Fraction(1) - fv[-1]] + [(b - a) / 2 for a, b in itertools.pairwise(fv)]
    )
    zero_code = sum(1 for t in thresholds if t <= 0.0)
    return QuantMap(
        name=name,
        bits=bits,
        signed=signed,
        values=values,
        thresholds=thresholds,
        zero_code=zero_code,
        max_error=_ceil_fp32(worst),
    )


MAPS: dict[str, QuantMap] = {
    m.name: m
    for m in (
        _make_map("dynamic-signed-8", 8, True, _dynamic_map(True, 7, 8)),
        _make_map("dynamic-unsigned-8", 8, False, _dynamic_map(False, 7, 8)),
        _make_map("dynamic-signed-4", 4, True, _dynamic_map(True, 3, 4)),
        _make_map("linear-nozero-4", 4, False, [Fraction(k, 16) for k in range(1, 17)]),
    )
}
"""Every map by name. See the module docstring for which moment uses which."""


@dataclass(frozen=True)
class Tables:
    """A map's tensors on one device (see [Note: Nearest code by table])."""

    values: torch.Tensor
    """fp32 ``(2**bits,)``: the map."""
    pairs: torch.Tensor
    """fp32 ``(256, 2)`` for 4-bit maps: the two values a packed byte holds (high nibble first);
    ``(256, 1)`` for 8-bit maps (the values)."""
    entry: torch.Tensor
    """int32 ``(65536,)``: per cell, ``base * 65536 + (65536 - t)`` where ``t`` is the low 16 bits
    of the key of the cell's threshold (``65536`` where the cell holds none)."""


def _key(bits: torch.Tensor) -> torch.Tensor:
    """int64 fp32 bit patterns (``[0, 2**32)``) -> their order-preserving int32 keys."""
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)
    return torch.where(signed < 0, signed ^ 0x7FFFFFFF, signed)


def _from_key(key: torch.Tensor) -> torch.Tensor:
    """int64 keys -> the fp32 values they order."""
    signed = torch.where(key < 0, key ^ 0x7FFFFFFF, key)
    return signed.to(torch.int32).view(torch.float32)


@functools.cache
def lookup_tables(name: str, device: torch.device) -> Tables:
    """The tables of map ``name`` on ``device`` (built once per process and device).

    Raises:
        RuntimeError: if a cell holds two thresholds (the table would not be exact; never for
            the maps of :data:`MAPS`, which the tests check).
    """
    qmap = MAPS[name]
    values = torch.tensor(qmap.values, dtype=torch.float32)
    thr = torch.tensor(qmap.thresholds, dtype=torch.float32)
    cell = torch.arange(65536, dtype=torch.int64)
    first = torch.where(cell < 0x8000, cell, cell - 0x10000) << 16  # the cell's lowest key
    lo, hi = _from_key(first), _from_key(first + 0xFFFF)
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    base = torch.bucketize(lo, thr, right=True)
    inside = torch.bucketize(hi, thr, right=True) - base
    if bool((inside[finite] > 1).any()):
        raise RuntimeError(
            f"map {name}: a 16-bit cell holds two thresholds; the table is not exact"
        )
    t = thr[base.clamp(max=thr.numel() - 1)]
    t_low = _key(t.view(torch.int32).long() & 0xFFFFFFFF) & 0xFFFF
    entry = base * 65536 + torch.where(inside == 1, 65536 - t_low, 0)
    entry = torch.where(finite, entry, 0)
    if qmap.bits == 4:
        byte = torch.arange(256)
        pairs = torch.stack([values[byte >> 4], values[byte & 0xF]], dim=1)
    else:
        pairs = values.view(256, 1)
    return Tables(
        values=values.to(device),
        pairs=pairs.contiguous().to(device),
        entry=entry.to(torch.int32).to(device),
    )
