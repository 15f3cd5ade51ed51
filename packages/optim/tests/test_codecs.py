"""The wire's block codecs against a plain torch reference, bit for bit ([Note: Block
quantization on the wire] in ``shardkit.optim._codecs``).

The reference pads the whole vector to whole blocks and quantizes it at once with the textbook
formula; the library encodes piece by piece through a fixed scratch. Single process.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.optim import WIRE_FORMATS, BlockFormat
from shardkit.optim import _codecs as codecs
from shardkit.optim._codecs import decode, decode_add, encode

_FORMATS = [
    WIRE_FORMATS["int8"],
    WIRE_FORMATS["int4"],
    BlockFormat(8, 16),
    BlockFormat(4, 4096),
]


def ref_encode(fmt: BlockFormat, x: torch.Tensor) -> torch.Tensor:
    """Scales (fp32 bytes) then codes, the whole vector at once."""
    n, nb = x.numel(), fmt.blocks(x.numel())
    xp = torch.zeros(nb * fmt.block)
    xp[:n] = x.float()
    rows = xp.view(nb, fmt.block)
    s = rows.abs().amax(1) / fmt.qmax
    q = (rows / torch.where(s == 0, 1.0, s)[:, None]).round()
    q = q.clamp(-fmt.qmax, fmt.qmax).nan_to_num(0.0).reshape(-1)
    if fmt.bits == 8:
        codes = q.to(torch.int8).view(torch.uint8)
    else:
        u = (q + 8).to(torch.uint8)
        codes = u[0::2] | (u[1::2] << 4)
    return torch.cat([s.view(torch.uint8), codes])


def ref_decode(fmt: BlockFormat, enc: torch.Tensor, n: int) -> torch.Tensor:
    nb = fmt.blocks(n)
    s, c = enc[: 4 * nb].view(torch.float32), enc[4 * nb :]
    if fmt.bits == 8:
        q = c.view(torch.int8).float()
    else:
        q = torch.stack([(c & 15).float() - 8, (c >> 4).float() - 8], 1).reshape(-1)
    return (q.view(nb, fmt.block) * s[:, None]).reshape(-1)[:n]


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 8192 elements, so a few thousand elements already cross pieces."""
    monkeypatch.setattr(codecs, "PIECE", 8192)


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(_FORMATS),
    n=st.one_of(st.integers(0, 70), st.integers(8000, 20_000)),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    zero_blocks=st.booleans(),
    scratch=st.booleans(),
)
def test_encode_decode_match_the_reference(
    fmt: BlockFormat, n: int, seed: int, dtype: torch.dtype, zero_blocks: bool, scratch: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * torch.rand(1, generator=g) * 10).to(dtype)
    if zero_blocks and n:
        x[: min(n, 2 * fmt.block)] = 0
    buf = torch.empty(2 * 8192) if scratch else None
    enc = torch.empty(fmt.nbytes(n), dtype=torch.uint8)
    encode(fmt, x, enc, buf)
    ref = ref_encode(fmt, x)
    assert torch.equal(enc, ref)
    out = torch.empty(n, dtype=torch.float32)
    decode(fmt, enc, out, buf)
    want = ref_decode(fmt, ref, n)
    assert torch.equal(out, want)
    acc = torch.randn(n, generator=g)
    before = acc.clone()
    decode_add(fmt, enc, acc, buf)
    assert torch.equal(acc, before + want)
    if n:  # round to nearest: half a step of the block's scale off, plus fp32 rounding
        err = (out - x.float()).abs()
        step = ref[: 4 * fmt.blocks(n)].view(torch.float32).repeat_interleave(fmt.block)[:n]
        assert bool((err <= step / 2 + x.float().abs() * 2**-21).all())


@pytest.mark.parametrize("fmt", _FORMATS[:2], ids=lambda f: f.name)
def test_a_non_finite_element_makes_its_block_nan(fmt: BlockFormat) -> None:
    """A gradient overflow reaches the loss scaler: its whole block decodes to NaN."""
    x = torch.randn(3 * fmt.block)
    x[1] = float("inf")
    x[fmt.block + 2] = float("nan")
    enc = torch.empty(fmt.nbytes(x.numel()), dtype=torch.uint8)
    encode(fmt, x, enc)
    out = torch.empty_like(x)
    decode(fmt, enc, out)
    assert bool(out[: 2 * fmt.block].isnan().all())
    assert bool(out[2 * fmt.block :].isfinite().all())


def test_stochastic_rounding_is_unbiased_and_stays_on_the_grid() -> None:
    fmt = BlockFormat(8, 256, stochastic=True)
    x = torch.full((256,), 0.3)
    x[0] = 127.0  # scale 1: codes of 0.3 are 0 or 1
    g = torch.Generator().manual_seed(0)
    total = torch.zeros(256)
    for _ in range(2000):
        enc = torch.empty(fmt.nbytes(256), dtype=torch.uint8)
        encode(fmt, x, enc, generator=g)
        out = torch.empty(256)
        decode(fmt, enc, out)
        assert set(out[1:].tolist()) <= {0.0, 1.0}
        total += out
    assert abs(float(total[1:].mean()) / 2000 - 0.3) < 0.01


def test_bytes_per_value() -> None:
    assert WIRE_FORMATS["int8"].nbytes(256 * 10) == 10 * (4 + 256)
    assert WIRE_FORMATS["int4"].nbytes(64 * 10) == 10 * (4 + 32)
    assert WIRE_FORMATS["int4"].nbytes(1) == 4 + 32  # one padded block
    assert WIRE_FORMATS["int8"].nbytes(0) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 2, "block": 64}, "bits must be 8 or 4"),
        ({"bits": 8, "block": 100}, "power of two"),
    ],
)
def test_bad_formats_raise(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BlockFormat(**kwargs)


def test_encoded_buffer_of_the_wrong_size_raises() -> None:
    with pytest.raises(ValueError, match="1-D uint8 tensor of 260 bytes"):
        encode(WIRE_FORMATS["int8"], torch.zeros(10), torch.empty(10, dtype=torch.uint8))
