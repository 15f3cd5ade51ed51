"""Exact fp32 masters of bf16 params in 16 extra bits: the bf16 param plus a signed int16 remainder.

[Note: Exact 16-bit remainder masters]
An fp32 value is 32 bits ``b``; its high 16 bits are a bf16 (same sign and exponent, 7 of the 23
mantissa bits). Keeping, beside a bf16 param ``h``, the int16 ``r`` such that
``b = (h << 16) + r`` (as 32-bit integers) makes ``(h, r)`` the exact fp32 master in 4 bytes, 2
of them the param the model already holds: +2 bytes per param instead of +4 for an fp32 master.

``split_master`` rounds: with ``low = b & 0xFFFF``, ``h = (b >> 16) + (low >= 0x8000)`` and
``r = low`` read as a signed int16 (``low - 0x10000`` when rounding went up). In value terms ``h``
is ``b`` rounded to the nearest bf16, ties *away from zero* (the bit pattern's magnitude goes
up); ``join_master`` inverts it exactly: ``b = h * 65536 + r`` in 32-bit two's complement. This is
TransformerEngine's ``store_param_remainders`` layout (``multi_tensor_adam``'s
``AdamFunctorMasterParamRemainder``: the int16 low half, the high half incremented when the low
half is negative as an int16).

Why not ties to even, as ``tensor.to(torch.bfloat16)`` rounds: for an even ``h`` both ties
``h ± 0x8000`` round to ``h`` under ties-to-even, so ``h`` has 65537 fp32 preimages and no
16-bit remainder can tell them apart; any exact 16-bit scheme must send one tie of each pair
elsewhere. So the params of a remainder run equal ``master.to(torch.bfloat16)`` of an fp32-master
run except where the master's low 16 bits are exactly ``0x8000`` and its truncation is even
(probability 2**-17 per element and step), where they are one bf16 unit further from zero; the
masters themselves, and so every update, are bit for bit those of the fp32 master run given the
same gradients.

Specials: ``±0``, subnormals, ``±inf`` and every finite value round trip exactly; a finite
master whose rounding overflows (``|b| >= 0x7F7F8000``) gets an infinite param, as ``.to()``
gives, and still joins back to itself. NaN masters split into a NaN param and remainder 0
(joining gives a NaN, not the original payload). ``join_master`` of a pair ``split_master``
never makes (a ``-0.0`` param with a negative remainder, the image of a positive NaN's
carry) gives NaN instead of overflowing.
"""

from __future__ import annotations

import torch

__all__ = ["join_master", "split_master"]


def _check(t: object, dtype: torch.dtype, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise TypeError(
            f"{what} must be a {dtype} tensor, got {type(t).__name__} {getattr(t, 'dtype', '')}"
        )
    return t


def split_master(
    master: torch.Tensor,
    param_out: torch.Tensor | None = None,
    remainder_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits fp32 ``master`` into a bf16 param (nearest, ties away from zero) and an int16
    remainder; see [Note: Exact 16-bit remainder masters].

    Args:
        master: fp32 tensor.
        param_out: optional bf16 tensor of ``master``'s shape to write the param into.
        remainder_out: optional int16 tensor of ``master``'s shape for the remainder.

    Returns:
        ``(param, remainder)``: the ``*_out`` tensors when given, else new ones.
    """
    _check(master, torch.float32, "master")
    for out, dtype, what in (
        (param_out, torch.bfloat16, "param_out"),
        (remainder_out, torch.int16, "remainder_out"),
    ):
        if out is not None and (_check(out, dtype, what).shape != master.shape):
            raise ValueError(f"{what} has shape {tuple(out.shape)}, master {tuple(master.shape)}")
    bits = master.contiguous().view(torch.int32)
    low = bits & 0xFFFF
    up = low >= 0x8000
    high = ((bits >> 16) & 0xFFFF) + up  # <= 0xFFFF unless the master is NaN (fixed below)
    nan = torch.isnan(master)
    high = torch.where(nan, 0x7FC0, high)  # bf16 quiet NaN
    param = torch.where(high >= 0x8000, high - 0x10000, high).to(torch.int16).view(torch.bfloat16)
    rem = torch.where(nan, 0, torch.where(up, low - 0x10000, low)).to(torch.int16)
    if param_out is not None:
        param_out.copy_(param)
        param = param_out
    if remainder_out is not None:
        remainder_out.copy_(rem)
        rem = remainder_out
    return param, rem


def join_master(
    param: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The exact fp32 master of a bf16 ``param`` and its int16 ``remainder``.

    Args:
        param: bf16 tensor.
        remainder: int16 tensor of the same shape.
        out: optional fp32 tensor of that shape to write into.

    Returns:
        ``out`` when given, else a new fp32 tensor.
    """
    _check(param, torch.bfloat16, "param")
    _check(remainder, torch.int16, "remainder")
    if remainder.shape != param.shape or (
        out is not None and _check(out, torch.float32, "out").shape != param.shape
    ):
        raise ValueError(
            f"param {tuple(param.shape)}, remainder {tuple(remainder.shape)} and out "
            f"{None if out is None else tuple(out.shape)} must have one shape"
        )
    high = param.contiguous().view(torch.int16).to(torch.int32)  # sign-extended high half
    rem = remainder.to(torch.int32)
    carry_of_nan = (high == -0x8000) & (rem < 0)  # never made by split_master (see the Note)
    # high * 65536 spans [-2**31, 2**31 - 65536]; adding rem overflows only for carry_of_nan.
    bits = high * 65536 + torch.where(carry_of_nan, 0, rem)
    bits = torch.where(carry_of_nan, 0x7FC00000, bits)
    value = bits.view(torch.float32)
    if out is None:
        return value
    out.copy_(value)
    return out
