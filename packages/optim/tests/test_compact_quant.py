"""The block-wise quantizer of compact optimizer state (``_compact_maps.py``, ``_compact.py``).

Properties, over shapes (``()``, ``(0,)``, ``(1,)``, sizes around block boundaries), source
dtypes (fp32, bf16, fp16) and value scales from subnormal to near overflow:

* the maps are the anchors' (torchao 0.18 / bitsandbytes, within 2 ulps; pinned bit for bit);
* the nearest-code table equals a binary search over the thresholds for every cell edge, every
  threshold and its neighbours, and random inputs;
* the error bound per block (``|s| * (max_error + 2**-22)``), flushing, poisoning;
* quantize after dequantize is the identity (codes and scales bit for bit);
* blocks live on the global flat index: quantizing block-aligned pieces separately, slicing
  the whole at other aligned cuts and concatenating give the same bits (reshards are exact);
* the transient memory of quantize / dequantize is one chunk, whatever the tensor's size.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from _optim_testkit import LiveStorages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardkit.optim._compact import (
    CHUNK,
    COMPACT_MIN_NUMEL,
    FORMATS,
    TRANSIENT_BYTES_PER_ELEMENT,
    CompactFormat,
    CompactTensor,
    align_cut,
    check_range,
    moment_formats,
    stores_compact,
)
from shardkit.optim._compact_maps import MAPS, lookup_tables

_SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
_FORMATS = [f for pair in FORMATS.values() for f in pair]
_FMT_IDS = [f.map_name for f in _FORMATS]
_SHAPES = [
    (),
    (0,),
    (1,),
    (2, 0, 3),
    (3,),
    (127,),
    (128,),
    (129,),
    (255,),
    (256,),
    (257,),
    (511,),
    (512,),
    (513,),
    (3, 100),
    (7, 73),
    (4097,),
    (2, 1280),
]
_SLACK = 2.0**-22
_TINY = 2.0**-126


def _codes(q: CompactTensor) -> torch.Tensor:
    """One code per element (4-bit codes unpacked, high nibble first)."""
    if q.fmt.bits == 8:
        return q.codes.long()
    return torch.stack([q.codes >> 4, q.codes & 0xF], dim=1).view(-1)[: q.numel].long()


def _block_scales(q: CompactTensor) -> torch.Tensor:
    """Each element's block scale."""
    return q.scales.repeat_interleave(q.fmt.block)[: q.numel]


def _source(
    shape: tuple[int, ...], seed: int, exponents: list[int], dtype: torch.dtype, signed: bool
) -> torch.Tensor:
    """Gaussian values, each block of 128 scaled by ``2**e`` for ``e`` cycling ``exponents``."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if not signed:
        x = x.square()
    blocks = torch.arange(n) // 128
    e = torch.tensor(exponents, dtype=torch.float64)[blocks % len(exponents)]
    x = (x * torch.exp2(e)).clamp(-3e38, 3e38)
    return x.to(dtype).reshape(shape)


_exponents = st.lists(
    st.sampled_from([-149, -140, -127, -126, -120, -60, -20, 0, 20, 60, 120]),
    min_size=1,
    max_size=4,
)


# ------------------------------------------------------------------------------ the maps


def test_maps_are_pinned() -> None:
    """The maps' bits never change: a checkpoint's codes mean the same values forever."""
    pins = {
        "dynamic-signed-8": ("035c4114538df2a0", "ae25a954f5c2b16e", 127),
        "dynamic-unsigned-8": ("02a9b523750e2134", "cd817f14c6bb3283", 0),
        "dynamic-signed-4": ("6190892bf956c63b", "8cec0f2d6c99a96a", 7),
        "linear-nozero-4": ("0aeb670b8c9b6b0f", "2ba75b736c9f369a", 0),
    }
    assert set(MAPS) == set(pins)
    for name, (values, thresholds, zero) in pins.items():
        m = MAPS[name]
        k = len(m.values)
        assert hashlib.sha256(struct.pack(f"<{k}f", *m.values)).hexdigest()[:16] == values
        assert (
            hashlib.sha256(struct.pack(f"<{k - 1}f", *m.thresholds)).hexdigest()[:16] == thresholds
        )
        assert m.zero_code == zero


@pytest.mark.parametrize("name", sorted(MAPS))
def test_maps_match_torchao(name: str) -> None:
    """Same construction as torchao 0.18's tables (bitsandbytes' for 8 bits), within 2 ulps.

    Our values are the exact formula rounded once; torchao rounds fp32 intermediates.
    """
    data = json.loads((Path(__file__).parent / "data" / "torchao_qmaps.json").read_text())
    theirs = torch.tensor([int(h, 16) for h in data[name]], dtype=torch.int64)
    ours = (
        torch.tensor(MAPS[name].values, dtype=torch.float32).view(torch.int32).long() & 0xFFFFFFFF
    )
    assert ours.numel() == theirs.numel() == 2 ** MAPS[name].bits
    ulps = (ours - theirs).abs()
    assert int(ulps.max()) <= 2
    differing = {
        "dynamic-signed-8": 72,
        "dynamic-unsigned-8": 100,
        "dynamic-signed-4": 4,
        "linear-nozero-4": 0,
    }
    assert int((ulps != 0).sum()) == differing[name]


@pytest.mark.parametrize("name", sorted(MAPS))
def test_map_invariants(name: str) -> None:
    m = MAPS[name]
    v = [float(x) for x in m.values]
    assert v == sorted(v) and len(set(v)) == len(v) == 2**m.bits and v[-1] == 1.0
    assert all(a < t <= b for a, t, b in zip(v, m.thresholds, v[1:], strict=False))
    for a, t, b in zip(v, m.thresholds, v[1:], strict=False):
        # t is the smallest fp32 at or above the exact midpoint
        below = torch.nextafter(torch.tensor(t), torch.tensor(-2.0)).item()
        assert (t - a) >= (b - t) and (below - a) < (b - below)
    assert m.values[m.zero_code] == min(m.values, key=abs)
    lo = -1.0 if m.signed else 0.0
    gaps = [(b - a) / 2 for a, b in itertools.pairwise(v)] + [v[0] - lo, 1.0 - v[-1]]
    assert max(gaps) <= m.max_error <= max(gaps) * (1 + 2**-22)


@pytest.mark.parametrize("fmt", _FORMATS, ids=_FMT_IDS)
def test_nearest_code_table_is_exact(fmt: CompactFormat) -> None:
    """Codes through the table equal a binary search (``torch.bucketize``) over the thresholds.

    Blocks whose first element is 1.0 have scale 1, so every other element is quantized as
    itself: every cell's edges, every threshold and its fp32 neighbours, ±0, subnormals and
    random bit patterns in [-1, 1].
    """
    m = fmt.qmap
    thr = torch.tensor(m.thresholds, dtype=torch.float32)
    cell = torch.arange(65536, dtype=torch.int64) << 16
    edges = torch.cat([cell, cell | 0xFFFF])
    edges = torch.where(edges >= 2**31, edges - 2**32, edges).to(torch.int32).view(torch.float32)
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    near = torch.cat([thr, torch.nextafter(thr, up), torch.nextafter(thr, down)])
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(-(2**31), 2**31, (1 << 20,), generator=g, dtype=torch.int64)
    rand = rand.to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.0, -1.0, 0.5, -0.5])
    r = torch.cat([edges, near, rand, special])
    r = r[torch.isfinite(r) & (r.abs() <= 1)]
    r = torch.cat([r, torch.zeros((-r.numel()) % (fmt.block - 1))])
    blocks = torch.cat([torch.ones(r.numel() // (fmt.block - 1), 1), r.view(-1, fmt.block - 1)], 1)
    q = CompactTensor.from_tensor(blocks.reshape(-1), fmt)
    assert bool((q.scales == 1.0).all())
    got = _codes(q).view(-1, fmt.block)[:, 1:].reshape(-1)
    want = torch.bucketize(r, thr, right=True)
    assert torch.equal(got, want)


def test_tables_are_cached_per_device() -> None:
    cpu = torch.device("cpu")
    assert lookup_tables("dynamic-signed-8", cpu) is lookup_tables("dynamic-signed-8", cpu)


# ------------------------------------------------------------------------------ round trips


@_SETTINGS
@given(
    shape=st.sampled_from(_SHAPES),
    seed=st.integers(0, 2**16),
    exponents=_exponents,
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fmt=st.sampled_from(_FORMATS),
)
def test_error_bound_and_idempotence(
    shape: tuple[int, ...],
    seed: int,
    exponents: list[int],
    dtype: torch.dtype,
    fmt: CompactFormat,
) -> None:
    """Per element ``|deq - x| <= |s| * (max_error + 2**-22)`` with ``s`` its block's scale;
    flushed blocks (absmax < 2**-126) dequantize to zeros; quantize(dequantize(q)) == q."""
    src = _source(shape, seed, exponents, dtype, fmt.qmap.signed)
    q = CompactTensor.from_tensor(src, fmt)
    assert q.shape == tuple(shape) and q.codes.dtype == torch.uint8
    assert q.nbytes == -(-q.numel * fmt.bits // 8) + 4 * -(-q.numel // fmt.block)
    x = src.reshape(-1).double()
    y = q.dequantize().reshape(-1).double()
    s = _block_scales(q).double()
    finite = torch.isfinite(x)
    # the scale: the block's signed extreme (positive on a tie) or its absmax (unsigned)
    for b in range(q.scales.numel()):
        block = x[b * fmt.block : (b + 1) * fmt.block]
        scale = q.scales[b].item()
        if not bool(torch.isfinite(block).all()):
            assert math.isnan(scale)
            continue
        amax = block.abs().max().item()
        if amax < _TINY:
            assert scale == 0.0
        elif fmt.qmap.signed:
            assert scale == (amax if block.max().item() == amax else -amax)
        else:
            assert scale == amax
    normal = torch.isfinite(s) & (s != 0)
    assert bool(((y - x).abs() <= s.abs() * (fmt.qmap.max_error + _SLACK))[normal].all())
    flushed = s == 0
    assert bool((y[flushed] == 0).all()) and bool((x[flushed].abs() < _TINY).all())
    assert bool(torch.isnan(y[~torch.isfinite(s)]).all())
    assert bool(finite[normal | flushed].all())
    again = CompactTensor.from_tensor(q.dequantize(), fmt)
    assert again.equal(q)


@pytest.mark.parametrize("fmt", _FORMATS, ids=_FMT_IDS)
@pytest.mark.parametrize("n", [0, 1, 5, 128, 256, 300, 4097])
def test_zeros(fmt: CompactFormat, n: int) -> None:
    z = CompactTensor.zeros((n,), fmt)
    assert z.equal(CompactTensor.from_tensor(torch.zeros(n), fmt))
    assert z.equal(CompactTensor.from_tensor(-torch.zeros(n), fmt))
    assert torch.equal(z.dequantize(), torch.zeros(n))


@pytest.mark.parametrize("fmt", _FORMATS, ids=_FMT_IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_poisons_its_block_only(fmt: CompactFormat, bad: float) -> None:
    """A NaN or inf makes its whole block NaN (scale NaN, zero codes); the others are intact."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3 * fmt.block + 5, generator=g).abs()
    clean = CompactTensor.from_tensor(x, fmt)
    x[fmt.block + 7] = bad
    q = CompactTensor.from_tensor(x, fmt)
    assert math.isnan(q.scales[1].item())
    y = q.dequantize()
    assert bool(torch.isnan(y[fmt.block : 2 * fmt.block]).all())
    keep = torch.ones(x.numel(), dtype=torch.bool)
    keep[fmt.block : 2 * fmt.block] = False
    assert torch.equal(y[keep], clean.dequantize()[keep])
    assert bool((_codes(q)[fmt.block : 2 * fmt.block] == fmt.qmap.zero_code).all())
    assert CompactTensor.from_tensor(y, fmt).equal(q)


def test_negative_extreme_is_exact() -> None:
    """[Note: Signed scale]: a block whose largest magnitude is negative keeps it exactly (the
    absmax scaling of torchao / bitsandbytes maps it to -0.99297 * absmax)."""
    for fmt in (FORMATS["int8"][0], FORMATS["int4"][0]):
        x = torch.linspace(-3.0, 1.0, fmt.block)
        q = CompactTensor.from_tensor(x, fmt)
        assert q.scales.item() == -3.0
        y = q.dequantize()
        assert y[0].item() == -3.0
        mirrored = CompactTensor.from_tensor(-x, fmt).dequantize()
        assert torch.equal(y, -mirrored)


@pytest.mark.parametrize("fmt", [FORMATS["int8"][1], FORMATS["int4"][1]], ids=["u8", "u4"])
def test_unsigned_maps_clamp_negative_inputs(fmt: CompactFormat) -> None:
    x = torch.tensor([4.0, -1.0, -4.0, 0.0] + [1.0] * (fmt.block - 4))
    y = CompactTensor.from_tensor(x, fmt).dequantize()
    low = fmt.qmap.values[0] * 4.0
    assert y[1].item() == y[2].item() == y[3].item() == low and y[0].item() == 4.0


def test_low_precision_out_and_shapes() -> None:
    fmt = FORMATS["int8"][0]
    x = torch.randn(3, 700)
    q = CompactTensor.from_tensor(x, fmt)
    out = torch.empty(3, 700, dtype=torch.bfloat16)
    q.dequantize(out=out)
    assert torch.equal(out, q.dequantize().to(torch.bfloat16))
    assert q.dequantize().shape == (3, 700)


# ------------------------------------------------------------------------------ global blocks


@_SETTINGS
@given(
    numel=st.sampled_from([1, 127, 128, 129, 256, 257, 1000, 4096, 5000, 70_000]),
    cuts_a=st.lists(st.integers(0, 70_000), max_size=6),
    cuts_b=st.lists(st.integers(0, 70_000), max_size=6),
    seed=st.integers(0, 2**16),
    fmt=st.sampled_from(_FORMATS),
    chunk_blocks=st.sampled_from([1, 3, 512]),
)
def test_sharding_invariance(
    numel: int,
    cuts_a: list[int],
    cuts_b: list[int],
    seed: int,
    fmt: CompactFormat,
    chunk_blocks: int,
) -> None:
    """[Note: Blocks on the global flat index]: quantizing the pieces of one aligned cut
    separately gives the whole param's bits; the pieces of any other aligned cut are slices of
    them; concatenating gives the whole back. So an N -> M reshard is a byte copy, exact."""
    x = _source((numel,), seed, [0, -30, 30], torch.float32, fmt.qmap.signed)
    whole = CompactTensor.from_tensor(x, fmt, chunk=chunk_blocks * fmt.block)
    assert whole.equal(CompactTensor.from_tensor(x, fmt))  # the chunk size does not matter

    def bounds(cuts: list[int]) -> list[int]:
        return sorted({0, numel, *(align_cut(numel, min(c, numel), fmt.block) for c in cuts)})

    a = bounds(cuts_a)
    pieces = [CompactTensor.from_tensor(x[lo:hi], fmt) for lo, hi in itertools.pairwise(a)]
    assert CompactTensor.cat(pieces).equal(whole.narrow(0, numel))
    b = bounds(cuts_b)
    resharded = [whole.narrow(lo, hi) for lo, hi in itertools.pairwise(b)]
    for (lo, hi), piece in zip(itertools.pairwise(b), resharded, strict=True):
        assert piece.equal(CompactTensor.from_tensor(x[lo:hi], fmt))
        assert torch.equal(piece.dequantize(), whole.dequantize()[lo:hi])
    assert CompactTensor.cat(resharded, shape=(numel,)).equal(whole)


@_SETTINGS
@given(numel=st.integers(0, 3000), cut=st.integers(0, 3000), block=st.sampled_from([128, 256]))
def test_align_cut(numel: int, cut: int, block: int) -> None:
    cut = min(cut, numel)
    got = align_cut(numel, cut, block)
    aligned = sorted({*range(0, numel + 1, block), numel})
    assert got in aligned
    best = min(abs(c - cut) for c in aligned)
    assert abs(got - cut) == best and got == min(c for c in aligned if abs(c - cut) == best)
    check_range(numel, 0, got, block)
    check_range(numel, got, numel, block)


def test_range_and_input_errors() -> None:
    fmt = FORMATS["int4"][0]
    q = CompactTensor.zeros((1000,), fmt)
    with pytest.raises(ValueError, match="whole blocks of 128"):
        q.narrow(100, 1000)
    with pytest.raises(ValueError, match="whole blocks"):
        q.quantize_range_(0, torch.zeros(100))
    with pytest.raises(ValueError, match="not contiguous"):
        q.quantize_(torch.zeros(2000)[::2])
    with pytest.raises(ValueError, match="1000 elements"):
        q.quantize_(torch.zeros(999))
    with pytest.raises(TypeError, match="floating"):
        q.quantize_(torch.zeros(1000, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of the block"):
        q.dequantize(chunk=100)
    with pytest.raises(ValueError, match="cut must be an int in"):
        align_cut(10, 11, 4)
    with pytest.raises(ValueError, match="one of"):
        moment_formats("int3")
    with pytest.raises(ValueError, match="even divisor"):
        CompactFormat("dynamic-signed-8", 100)
    with pytest.raises(ValueError, match="unknown quantization map"):
        CompactFormat("fp8", 256)
    with pytest.raises(ValueError, match="contiguous with 8 elements"):
        CompactTensor(torch.zeros(7, dtype=torch.uint8), torch.zeros(1), (16,), fmt)
    with pytest.raises(ValueError, match="only the last piece"):
        CompactTensor.cat([CompactTensor.zeros((5,), fmt), CompactTensor.zeros((5,), fmt)])


def test_stores_compact_policy() -> None:
    """Decided on the param's global size and dtype, never on a shard's."""
    assert stores_compact(COMPACT_MIN_NUMEL, torch.float32)
    assert stores_compact(6144, torch.bfloat16)  # 8-bit whatever the world size (issue 40)
    assert not stores_compact(COMPACT_MIN_NUMEL - 1, torch.float32)
    for dtype in (torch.float64, torch.complex64, torch.int64):
        assert not stores_compact(1 << 20, dtype)


# ------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", _FORMATS, ids=_FMT_IDS)
def test_transient_memory_is_one_chunk(fmt: CompactFormat, dtype: torch.dtype) -> None:
    """[Note: Bounded transient memory]: the peak of live temporaries is the same for a 4-chunk
    and a 16-chunk tensor, and under TRANSIENT_BYTES_PER_ELEMENT per chunk element."""
    lookup_tables(fmt.map_name, torch.device("cpu"))  # built once per process: not transient
    peaks = []
    for n in (4 * CHUNK + 3, 16 * CHUNK + 3):
        x = torch.randn(n).to(dtype)
        q = CompactTensor.zeros((n,), fmt)
        out = torch.empty(n)
        with LiveStorages() as quant:
            q.quantize_(x)
        with LiveStorages() as dequant:
            q.dequantize(out=out)
        peaks.append((quant.peak, dequant.peak))
    assert peaks[0] == peaks[1]
    assert 0 < max(peaks[0]) <= TRANSIENT_BYTES_PER_ELEMENT * CHUNK


# ------------------------------------------------------------------------------ torchao


@pytest.mark.parametrize("fmt", _FORMATS, ids=_FMT_IDS)
def test_codes_match_torchao_on_positive_blocks(fmt: CompactFormat) -> None:
    """Where torchao's absmax scale and our signed scale coincide (the block's extreme is
    positive), the codes are torchao's but for inputs within rounding of a midpoint.

    Reference only: torchao is not a dependency; the test runs where it is installed.
    """
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    data = json.loads((Path(__file__).parent / "data" / "torchao_qmaps.json").read_text())
    qmap = torch.tensor([int(h, 16) for h in data[fmt.map_name]], dtype=torch.int64)
    qmap = torch.where(qmap >= 2**31, qmap - 2**32, qmap).to(torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, fmt.block, generator=g)
    if not fmt.qmap.signed:
        x = x.square()
    x[:, 0] = x.abs().amax(1) * 1.5  # a positive extreme
    scaled, _ = quant_utils.scale_tensor(x.reshape(-1), fmt.block)
    quant = (
        quant_utils.quantize_8bit_with_qmap
        if fmt.bits == 8
        else quant_utils.quantize_4bit_with_qmap
    )
    theirs = quant(scaled, qmap).long()
    ours = _codes(CompactTensor.from_tensor(x.reshape(-1), fmt))
    differ = ours != theirs
    assert int(differ.sum()) <= x.numel() // 10_000
    assert bool(((ours - theirs).abs() <= 1).all())
