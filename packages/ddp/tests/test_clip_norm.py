"""Issue 39: ``ShardedDataParallel.clip_grad_norm_`` (and a wrapped ``optimizer.clip_grad_norm``)
is shardkit-optim's one sharded clip.

- Accuracy: the total norm is within rtol 1e-6 of an fp64 reference (``vector_norm`` of every
  gradient in float64) for params of millions of elements, norm types 2, inf and 1, at world 2
  and 3, and with bf16 params stepped through fp32 masters. One fp32 norm per long flat shard
  was 1e-5 to 1e-4 off here (torch's CPU kernel accumulates a long reduction in fp32).
- Agreement: ranks that pass different ``max_norm`` or ``norm_type`` raise ``ValueError`` on
  every rank, naming each rank's values, instead of each clipping its shard with its own value.
- The clip's one all-gather goes through the wrapper's counting layer (``comm_stats``).

The gradients are known exactly: ``forward`` is ``sum(p * c_p)``, so every rank's gradient of
``p`` is ``c_p`` (the same on every rank) and the averaged gradient is ``c_p`` up to the last bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn

# Two params of over a million elements (odd sizes: the shards split them), small ones beside.
SIZES = [(1 << 20) + 3, (2 << 20) - 5, 1000, 7, 1]


class _Known(nn.Module):
    """``forward() = sum(p * c_p)``: the gradient of ``p`` is ``c_p``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        scales = [1e-3, 1e-3, 1e-1, 1.0, 1e-2]
        self.coefs = [
            (torch.randn(n, generator=g) * s).to(dtype) for n, s in zip(SIZES, scales, strict=True)
        ]
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(n, dtype=dtype)) for n in SIZES)

    def forward(self) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.ps, self.coefs, strict=True))  # type: ignore[return-value]

    def reference(self, norm_type: float) -> float:
        """The fp64 norm of the gradients."""
        flat = torch.cat([c.double() for c in self.coefs])
        return float(torch.linalg.vector_norm(flat, norm_type))


def _wrap(dtype: torch.dtype) -> tuple[_Known, ShardedDataParallel, ShardedOptimizer]:
    m = _Known(dtype)
    kw = {"master_dtype": torch.float32} if dtype != torch.float32 else {}
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1, **kw)
    return m, ShardedDataParallel(m, opt), opt


def _check_accuracy(dtype: torch.dtype, norm_types: tuple[float, ...]) -> None:
    m, sdp, opt = _wrap(dtype)
    for k, norm_type in enumerate(norm_types):
        opt.zero_grad()
        sdp().backward()
        want = m.reference(norm_type)
        clip = opt.clip_grad_norm if k % 2 else sdp.clip_grad_norm_
        got = clip(0.5 * want, norm_type)  # active: every gradient is halved
        assert got.dtype == torch.float32 and got.dim() == 0
        assert math.isclose(float(got), want, rel_tol=1e-6), (norm_type, float(got), want)
    # the clip coefficient reached the step: SGD moves each param by lr * coef * c
    opt.step()
    sdp.wait_params()
    coef = 0.5 * want / (float(got) + 1e-6)
    expect = -0.1 * coef * m.coefs[2].double()
    torch.testing.assert_close(
        m.ps[2].detach().double(), expect, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=0
    )


@world(2, timeout=240)
def test_clip_norm_matches_fp64_reference() -> None:
    _check_accuracy(torch.float32, (2.0, math.inf, 1.0))


@world(2, timeout=240)
def test_clip_norm_with_bf16_params_and_fp32_masters() -> None:
    _check_accuracy(torch.bfloat16, (2.0, 1.0))


@world(3, timeout=240)
def test_clip_norm_matches_fp64_reference_world3() -> None:
    _check_accuracy(torch.float32, (2.0,))


@pytest.mark.parametrize("via", ["wrapper", "optimizer"])
@world(2)
def test_clip_mismatch_raises_on_every_rank(via: str) -> None:
    m, sdp, opt = _wrap(torch.float32)
    sdp().backward()
    clip = sdp.clip_grad_norm_ if via == "wrapper" else opt.clip_grad_norm
    rank = dist.get_rank()
    with pytest.raises(
        ValueError,
        match=r"ranks pass different \(max_norm, norm_type\): rank 0: \(1\.0, 2\.0\), "
        r"rank 1: \(0\.5, 2\.0\); pass the same values on every rank",
    ):
        clip(1.0 if rank == 0 else 0.5)
    with pytest.raises(ValueError, match=r"rank 0: \(1\.0, 2\.0\), rank 1: \(1\.0, inf\)"):
        clip(1.0, 2.0 if rank == 0 else math.inf)
    # Nothing was clipped: the same gradients clip once with agreeing values, counted once.
    calls = sdp.comm_stats.calls["all_gather"]
    nbytes = sdp.comm_stats.buffer_bytes["all_gather"]
    got = clip(1e9)
    assert math.isclose(float(got), m.reference(2.0), rel_tol=1e-6)
    assert sdp.comm_stats.calls["all_gather"] == calls + 1
    assert sdp.comm_stats.buffer_bytes["all_gather"] == nbytes + 2 * 5 * 8  # 2 rows of 5 fp64
    with pytest.raises(RuntimeError, match="already called on these gradients"):
        clip(1e9)
    opt.step()


@world(2)
def test_invalid_clip_values_raise_on_every_rank() -> None:
    _, sdp, opt = _wrap(torch.float32)
    sdp().backward()
    with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
        sdp.clip_grad_norm_(-1.0)
    with pytest.raises(ValueError, match="norm_type must be positive"):
        sdp.clip_grad_norm_(1.0, 0.0)
    with pytest.raises(TypeError, match="max_norm must be a number, got str"):
        sdp.clip_grad_norm_("1.0")  # type: ignore[arg-type]
    assert sdp.clip_grad_norm_(1.0) > 0
    opt.step()
