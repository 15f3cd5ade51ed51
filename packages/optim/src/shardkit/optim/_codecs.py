"""The codecs of the wire layer: how a bucket's values travel (``shardkit.optim._wire``).

A codec says what one bucket collective puts on the wire and how the receiver turns it back
into values. The exact codecs are today's reduce paths: the bucket's own dtype, or a
``reduce_dtype`` (bf16 / fp16) the gradients are staged in; the collective sums them. The block
codecs (:class:`BlockFormat`: ``int8``, ``int4``) quantize; the wire layer then moves their
bytes with an all-to-all (gradients) or an all-gather (weight deltas) and sums or adds the
decoded values itself.

[Note: Block quantization on the wire]
A vector of ``n`` values is cut into blocks of ``block`` elements along the flat bucket (the
last one padded with zeros). Each block has one fp32 scale, ``absmax / qmax`` (``qmax`` 127 for
int8, 7 for int4: symmetric, so 0 is exact and the codes of a block span its extremes), and
each element the code ``clamp(round(x / scale), -qmax, qmax)`` (``round`` is torch's, half to
even; a block of zeros has scale 0 and codes 0; with ``stochastic=True`` ``floor(x / scale +
u)``, ``u`` uniform in [0, 1) from the wire's generator, unbiased). The decoded value is
``code * scale`` in fp32. A block holding an inf or a NaN has a non-finite scale and decodes to
NaN everywhere, so a gradient overflow reaches the loss scaler's check (it skips the step).
Encoded, ``n`` values take ``blocks * 4`` bytes of scales followed by ``blocks * block``
int8 codes, or ``blocks * block / 2`` bytes of int4 codes, two per byte (``code + 8``, the
even element in the low nibble). So int8 costs ``1 + 4 / block`` bytes per value, int4
``0.5 + 4 / block``, scales included; with the default blocks (int8: 256, int4: 64) 1.016 and
0.5625 bytes, 0.254x and 0.141x of fp32.

Both directions work through a fixed fp32 scratch of twice :data:`PIECE` elements lent by the wire
layer, piece by piece, so neither allocates more than a
piece's block scales; ``tests/test_codecs.py`` checks them bit for bit against a plain torch
reference that pads and quantizes the whole vector at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PIECE", "WIRE_FORMATS", "BlockFormat", "decode", "decode_add", "encode"]

PIECE = 1 << 18
"""Elements per pass of the encoder and decoder through their scratch (a multiple of every
block size): 1 MiB of fp32 scratch."""


@dataclass(frozen=True)
class BlockFormat:
    """A block-quantized wire format ([Note: Block quantization on the wire])."""

    bits: int
    """Bits per code: 8 or 4."""
    block: int
    """Elements per block (one fp32 scale each): a power of two from 16 to 4096."""
    stochastic: bool = False
    """Round stochastically (unbiased) instead of to nearest."""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"BlockFormat.bits must be 8 or 4, got {self.bits!r}")
        if not (
            isinstance(self.block, int)
            and 16 <= self.block <= 4096
            and not self.block & (self.block - 1)
        ):
            raise ValueError(
                f"BlockFormat.block must be a power of two from 16 to 4096, got {self.block!r}"
            )

    @property
    def name(self) -> str:
        """``"int8"`` or ``"int4"``."""
        return f"int{self.bits}"

    @property
    def qmax(self) -> int:
        """The largest code: 127 or 7."""
        return (1 << (self.bits - 1)) - 1

    def blocks(self, n: int) -> int:
        """Blocks of ``n`` values."""
        return -(-n // self.block)

    def scale_bytes(self, n: int) -> int:
        """Bytes of the scales of ``n`` encoded values."""
        return 4 * self.blocks(n)

    def nbytes(self, n: int) -> int:
        """Bytes of ``n`` encoded values, scales included."""
        nb = self.blocks(n)
        return 4 * nb + nb * self.block * self.bits // 8

    @staticmethod
    def scratch_numel(n: int) -> int:
        """fp32 elements of the scratch that encoding or decoding ``n`` values uses."""
        m = min(n, PIECE)
        return 2 * (m + (m & 1))

    def encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        scratch: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """Encodes ``x`` into ``out`` (:func:`encode`)."""
        encode(self, x, out, scratch, generator)

    def decode(
        self, enc: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> None:
        """``out = decode(enc)`` (:func:`decode`)."""
        decode(self, enc, out, scratch)

    def decode_add(
        self, enc: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> None:
        """``out += decode(enc)`` (:func:`decode_add`)."""
        decode_add(self, enc, out, scratch)


WIRE_FORMATS: dict[str, BlockFormat] = {
    "int8": BlockFormat(8, 256),
    "int4": BlockFormat(4, 64),
}
"""The block formats ``ShardedDataParallel(wire=...)`` names."""


def _parts(fmt: BlockFormat, enc: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, codes) views of the encoded bytes of ``n`` values."""
    nb = fmt.blocks(n)
    if enc.dtype != torch.uint8 or enc.dim() != 1 or enc.numel() != fmt.nbytes(n):
        raise ValueError(
            f"encoded {fmt.name} values of {n} elements take a 1-D uint8 tensor of "
            f"{fmt.nbytes(n)} bytes, got {tuple(enc.shape)} {enc.dtype}"
        )
    return enc[: 4 * nb].view(torch.float32), enc[4 * nb :]


def _scratch(scratch: torch.Tensor | None, m: int, device: torch.device) -> torch.Tensor:
    if scratch is None:
        return torch.empty(m, dtype=torch.float32, device=device)
    return scratch[:m]


def encode(
    fmt: BlockFormat,
    x: torch.Tensor,
    out: torch.Tensor,
    scratch: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """Encodes the 1-D float tensor ``x`` into ``out`` (uint8, ``fmt.nbytes(x.numel())``).

    ``scratch``: fp32, at least :meth:`BlockFormat.scratch_numel` elements, on ``x``'s
    device; allocated per piece when ``None``.
    """
    n = x.numel()
    scales, codes = _parts(fmt, out, n)
    block, qmax = fmt.block, float(fmt.qmax)
    with torch.no_grad():
        for start in range(0, n, PIECE):
            m = min(PIECE, n - start)
            mm = m + (m & 1)  # int4 pairs: an odd last piece gets a zero partner
            tmp = _scratch(scratch, mm, x.device)
            tmp[:m].copy_(x[start : start + m])
            if mm > m:
                tmp[m:].zero_()
            full, tail = divmod(m, block)
            b0 = start // block
            mag = _scratch(None if scratch is None else scratch[mm:], m, x.device)
            torch.abs(tmp[:m], out=mag)  # then a plain max per block (a fused inf-norm is 10x slower)
            if full:
                rows = tmp[: full * block].view(full, block)
                s = mag[: full * block].view(full, block).amax(1).div_(qmax)
                scales[b0 : b0 + full].copy_(s)
                rows.div_(torch.where(s == 0, 1.0, s).unsqueeze(1))
            if tail:
                last = tmp[full * block : m]
                s1 = mag[full * block : m].amax().div_(qmax)
                scales[b0 + full].copy_(s1)
                last.div_(torch.where(s1 == 0, 1.0, s1))
            if fmt.stochastic:
                noise = _scratch(None if scratch is None else scratch[mm:], m, x.device)
                torch.rand(m, generator=generator, device=x.device, out=noise)
                tmp[:m].add_(noise).floor_()
            else:
                tmp.round_()
            tmp.clamp_(-qmax, qmax).nan_to_num_(0.0)
            if fmt.bits == 8:
                codes[start : start + m].view(torch.int8).copy_(tmp[:m])
            else:
                lo, hi = tmp[0::2], tmp[1::2]
                hi.add_(8.0).mul_(16.0)
                lo.add_(8.0).add_(hi)
                codes[start // 2 : (start + mm) // 2].copy_(lo)
        # the padding of the last block: code 0 (int4: nibble 8)
        used = n if fmt.bits == 8 else -(-n // 2)
        codes[used:].fill_(0 if fmt.bits == 8 else 0x88)


_PAIRS: dict[torch.device, torch.Tensor] = {}


def _pairs(device: torch.device) -> torch.Tensor:
    """The two int4 codes of each byte value, as fp32 (256 x 2: low nibble first)."""
    table = _PAIRS.get(device)
    if table is None:
        b = torch.arange(256, device=device)
        table = _PAIRS[device] = torch.stack([(b & 15) - 8, (b >> 4) - 8], 1).float()
    return table


def _decoded(
    fmt: BlockFormat,
    scales: torch.Tensor,
    codes: torch.Tensor,
    start: int,
    m: int,
    scratch: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """fp32 values ``[start, start + m)`` of an encoded vector (``start`` a piece's)."""
    mm = m + (m & 1)
    tmp = _scratch(scratch, mm, device)
    if fmt.bits == 8:
        tmp[:m].copy_(codes[start : start + m].view(torch.int8))
    else:  # one lookup per byte: its two codes (a table of 256 pairs; 2x the arithmetic's speed)
        rest = _scratch(None if scratch is None else scratch[mm:], mm, device)
        index = rest.view(torch.int64)[: mm // 2]
        index.copy_(codes[start // 2 : (start + mm) // 2])
        torch.index_select(_pairs(device), 0, index, out=tmp.view(-1, 2))
    block = fmt.block
    full, tail = divmod(m, block)
    b0 = start // block
    if full:
        tmp[: full * block].view(full, block).mul_(scales[b0 : b0 + full].unsqueeze(1))
    if tail:
        tmp[full * block : m].mul_(scales[b0 + full])
    return tmp[:m]


def decode_add(
    fmt: BlockFormat, enc: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None
) -> None:
    """``out += decode(enc)``, each value decoded in fp32 and added in ``out``'s dtype
    arithmetic (``out.add_``)."""
    n = out.numel()
    scales, codes = _parts(fmt, enc, n)
    with torch.no_grad():
        for start in range(0, n, PIECE):
            m = min(PIECE, n - start)
            out[start : start + m].add_(_decoded(fmt, scales, codes, start, m, scratch, out.device))


def decode(
    fmt: BlockFormat, enc: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None
) -> None:
    """``out = decode(enc)`` (cast to ``out``'s dtype)."""
    n = out.numel()
    scales, codes = _parts(fmt, enc, n)
    with torch.no_grad():
        for start in range(0, n, PIECE):
            m = min(PIECE, n - start)
            out[start : start + m].copy_(
                _decoded(fmt, scales, codes, start, m, scratch, out.device)
            )
