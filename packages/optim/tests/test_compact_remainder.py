"""Exact 16-bit remainder masters (``_remainder.py``): bf16 param + int16 remainder == fp32.

Over fp32 bit patterns (every sign, exponent and mantissa: subnormals, ±0, values at and next to
bf16 rounding ties, near overflow, inf): ``join_master(split_master(x)) == x`` bit for bit; the
param is ``x`` rounded to nearest, ties away from zero, so it equals torch's ``.to(bfloat16)``
(ties to even) everywhere except at the ties that no 16-bit remainder can keep (see [Note: Exact
16-bit remainder masters]); an AdamW step through (join -> step -> split) is the fp32-master
step followed by that rounding.
"""

from __future__ import annotations

import pytest
import torch
from _compact_testkit import masters_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardkit.optim._compact_step import AdamState
from shardkit.optim._remainder import join_master, split_master

_SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
_NAN = 0x7FC00000


def _as_fp32(bits: list[int]) -> torch.Tensor:
    b = torch.tensor(bits, dtype=torch.int64) & 0xFFFFFFFF
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).long() & 0xFFFFFFFF


# high 16 bits x low 16 bits, the low half concentrated where rounding decides
_low = st.one_of(st.sampled_from([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF]), st.integers(0, 0xFFFF))
_high = st.one_of(
    st.sampled_from(
        [
            0x0000,
            0x0001,
            0x007F,
            0x0080,
            0x3F80,
            0x7F7E,
            0x7F7F,
            0x7F80,
            0x8000,
            0x8001,
            0xBF80,
            0xFF7F,
            0xFF80,
        ]
    ),
    st.integers(0, 0xFFFF),
)
_patterns = st.lists(
    st.tuples(_high, _low).map(lambda hl: hl[0] << 16 | hl[1]), min_size=1, max_size=64
)


@_SETTINGS
@given(bits=_patterns)
def test_round_trip_is_exact(bits: list[int]) -> None:
    x = _as_fp32(bits)
    param, rem = split_master(x)
    assert param.dtype == torch.bfloat16 and rem.dtype == torch.int16
    back = join_master(param, rem)
    nan = torch.isnan(x)
    assert torch.equal(_bits(back)[~nan], _bits(x)[~nan])
    assert bool(torch.isnan(back[nan]).all()) and bool(torch.isnan(param[nan]).all())
    assert bool((rem[nan] == 0).all())


@_SETTINGS
@given(bits=_patterns)
def test_param_is_round_to_nearest_ties_away(bits: list[int]) -> None:
    """The param is ``.to(bfloat16)`` (ties to even) except at a tie whose truncation is even,
    where it is the other neighbour, one bf16 unit further from zero."""
    x = _as_fp32(bits)
    finite_or_inf = ~torch.isnan(x)
    param = split_master(x)[0][finite_or_inf]
    rne = x.to(torch.bfloat16)[finite_or_inf]
    b = _bits(x)[finite_or_inf]
    tie_even = ((b & 0xFFFF) == 0x8000) & (((b >> 16) & 1) == 0)
    p16, r16 = _bits(param.float()) >> 16, _bits(rne.float()) >> 16
    assert torch.equal(p16[~tie_even], r16[~tie_even])
    assert torch.equal(p16[tie_even], r16[tie_even] + 1)  # magnitude up, in either sign
    # nearest: |param - x| <= half a bf16 unit, i.e. the distance to the truncation's neighbour
    trunc = (b >> 16) << 16
    exact = (b & 0xFFFF) != 0x8000
    up = (b & 0xFFFF) > 0x8000
    assert torch.equal((p16 << 16)[exact & ~up & ~tie_even], trunc[exact & ~up & ~tie_even])


def test_edges() -> None:
    cases = {
        0x00000000: (0x0000, 0),  # +0
        0x80000000: (0x8000, 0),  # -0
        0x00000001: (0x0000, 1),  # smallest subnormal
        0x00008000: (0x0001, -0x8000),  # a subnormal tie: up
        0x3F808000: (0x3F81, -0x8000),  # 1 + 2**-8: even truncation, ties away (RNE: 0x3F80)
        0x3F818000: (0x3F82, -0x8000),  # odd truncation: same as RNE
        0x7F7F7FFF: (0x7F7F, 0x7FFF),  # largest value that keeps a finite param
        0x7F7F8000: (0x7F80, -0x8000),  # rounds to +inf, still joins back exactly
        0x7F7FFFFF: (0x7F80, -1),  # fp32 max
        0x7F800000: (0x7F80, 0),  # +inf
        0xFF800000: (0xFF80, 0),  # -inf
        0xFF7FFFFF: (0xFF80, -1),  # -fp32 max
    }
    x = _as_fp32(list(cases))
    param, rem = split_master(x)
    assert (_bits(param.float()) >> 16).tolist() == [h for h, _ in cases.values()]
    assert rem.tolist() == [r for _, r in cases.values()]
    assert torch.equal(_bits(join_master(param, rem)), _bits(x))


def test_nan_and_foreign_pairs() -> None:
    """NaN masters give a NaN param; a pair split_master never makes (a -0.0 param with a
    negative remainder, a positive NaN's carry) joins to NaN instead of overflowing."""
    x = _as_fp32([0x7F800001, 0x7FFF8000, 0xFFFFFFFF, _NAN])
    param, rem = split_master(x)
    assert bool(torch.isnan(param).all()) and bool((rem == 0).all())
    foreign = join_master(
        torch.tensor([-0.0, 1.0], dtype=torch.bfloat16), torch.tensor([-5, -5], dtype=torch.int16)
    )
    assert _bits(foreign)[0].item() == _NAN
    assert foreign[1].item() == _as_fp32([0x3F800000 - 5]).item()


def test_out_arguments_and_errors() -> None:
    x = torch.randn(3, 4)
    p_out = torch.empty(3, 4, dtype=torch.bfloat16)
    r_out = torch.empty(3, 4, dtype=torch.int16)
    p, r = split_master(x, p_out, r_out)
    assert p is p_out and r is r_out
    out = torch.empty(3, 4)
    assert join_master(p, r, out=out) is out and torch.equal(out, x)
    with pytest.raises(TypeError, match="float32"):
        split_master(x.double())
    with pytest.raises(TypeError, match="bfloat16"):
        join_master(x.half(), r)
    with pytest.raises(ValueError, match="one shape"):
        join_master(p, r[:2])
    with pytest.raises(ValueError, match="shape"):
        split_master(x, p_out[:2])


@_SETTINGS
@given(
    bits=st.lists(
        st.tuples(st.sampled_from([0x3C00, 0x3F80, 0xBF80, 0x4100, 0xC100]), _low).map(
            lambda hl: hl[0] << 16 | hl[1]
        ),
        min_size=8,
        max_size=300,
    ),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from([None, "int8"]),
)
def test_step_through_remainders_is_the_fp32_master_step(
    bits: list[int], seed: int, kind: str | None
) -> None:
    """join -> AdamW step -> split equals stepping the fp32 master and splitting it, bit for bit,
    over masters next to rounding ties; and the masters are exactly those of an fp32-master
    run, so a remainder run's params differ from ``master.to(bfloat16)`` only at even ties."""
    master = _as_fp32(bits)
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(master.shape, generator=g).to(torch.bfloat16) for _ in range(3)]
    hp = dict(lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True)
    ref_master = master.clone()
    ref_param = master.to(torch.bfloat16)
    ref_state = [AdamState.zeros(ref_master, kind)]
    param, rem = split_master(master)
    state = [AdamState.zeros(master, kind)]
    for grad in grads:
        # the library's path of master weights (_master_set.py) around the compact step
        masters, _ = masters_step([ref_param], [grad], ref_state, masters=[ref_master], **hp)
        _, remainders = masters_step([param], [grad], state, remainders=[rem], **hp)
        assert masters is not None and remainders is not None
        ref_master, rem = masters[0], remainders[0]
        assert torch.equal(_bits(join_master(param, rem)), _bits(ref_master))
        assert torch.equal(_bits(param.float()), _bits(split_master(ref_master)[0].float()))
        b = _bits(ref_master)
        tie_even = ((b & 0xFFFF) == 0x8000) & (((b >> 16) & 1) == 0)
        same = _bits(param.float()) == _bits(ref_param.float())
        assert torch.equal(same, ~tie_even)
