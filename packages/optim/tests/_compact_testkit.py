"""Shared helpers of the compact-state tests (``test_compact_zero1.py``, ``test_compact_zero2.py``):
a small model whose two 8192-element weights store compact moments, its batches, and the
reference: a plain torch optimizer whose moments are requantized after each step."""

from __future__ import annotations

from typing import Any

import torch
from shardkit.optim._compact import CompactTensor, moment_formats, stores_compact
from shardkit.optim._compact_step import AdamState, StepScratch, compact_adam_step
from shardkit.optim._master_set import MasterSet, Stepped
from shardkit.optim._remainder import join_master
from torch import nn

__all__ = [
    "J",
    "K",
    "Reference",
    "assert_close_step",
    "equal",
    "groups",
    "loss",
    "masters_step",
    "model",
    "train",
]

K, J = 3, 2  # steps before and after a checkpoint


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)  # two 8192-element weights (compact), the rest full precision
    m = nn.Sequential(
        nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 16), nn.Tanh(), nn.Linear(16, 3)
    )
    return m.to(dtype)


def groups(model: nn.Module) -> list[dict[str, Any]]:
    ps = list(model.parameters())
    return [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3}]


def loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)
    return nn.functional.mse_loss(model(x.to(dtype)).float(), y)


class Reference:
    """The plain optimizer (on fp32 copies of a low-precision model), its moments requantized
    after each step for the params :func:`stores_compact` picks."""

    def __init__(self, model: nn.Module, cls: type[torch.optim.Optimizer], kind: str, **kw: Any):
        self.model, self.kind = model, kind
        self.value = {
            p: (p if p.dtype == torch.float32 else p.detach().float().clone())
            for p in model.parameters()
        }
        gs = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [self.value[p] for p in g["params"]],
            }
            for g in groups(model)
        ]
        self.opt = cls(gs, **kw)

    def step(self) -> None:
        for p, v in self.value.items():
            if v is not p:
                v.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for v, st in self.opt.state.items():
            if not stores_compact(v.numel(), v.dtype):
                continue
            first, second = moment_formats(self.kind)
            for name, fmt in (
                ("exp_avg", first),
                ("exp_avg_sq", second),
                ("max_exp_avg_sq", second),
            ):
                if name in st:
                    st[name].copy_(CompactTensor.from_tensor(st[name], fmt).dequantize())
        with torch.no_grad():
            for p, v in self.value.items():
                if v is not p:
                    p.copy_(v)


def train(model: nn.Module, opt: Any, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        model.zero_grad()
        loss(model, step).backward()
        opt.step()


def equal(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{what}: {name} differs by {(p.float() - q.float()).abs().max()}"


def masters_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    states: list[AdamState],
    *,
    masters: list[torch.Tensor] | None = None,
    remainders: list[torch.Tensor] | None = None,
    grad_factors: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
    scratch: StepScratch | None = None,
    **kw: Any,
) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """One compact step of bf16/fp16 ``params`` through the library's path of master weights:
    a ``MasterSet`` (``_master_set.py``) made from the exact ``masters`` (or the params and
    ``remainders``) upcasts the gradients times ``grad_factors`` (and joins the remainder
    masters), :func:`compact_adam_step` steps the fp32 masters, the masters cast (or split)
    back into ``params``, in place. Returns the new ``(masters, remainders)``."""
    ms = MasterSet(torch.float32, remainder=remainders is not None)
    items = [Stepped(p, p) for p in params]
    if masters is not None:
        values = masters
    else:
        assert remainders is not None
        values = [join_master(p, r) for p, r in zip(params, remainders, strict=True)]
    ms.attach(items, list(values))
    for f in grad_factors:
        ms.factors.add(f)
    part = [s for s, g in zip(items, grads, strict=True) if g is not None]

    def run() -> None:  # what the compact optimizer's step does with the masters
        opt = [s.opt for s in items]
        compact_adam_step(opt, [t.grad for t in opt], states, scratch=scratch, **kw)

    ms.step(part, [g for g in grads if g is not None], ms.kept, run)
    if masters is not None:
        return [s.opt for s in items], None
    return None, [s.remainder for s in items if s.remainder is not None]


def _ulps(x: torch.Tensor) -> torch.Tensor:
    """The spacing of fp32 at ``|x|``."""
    a = x.abs()
    return torch.nextafter(a, torch.full_like(a, torch.inf)) - a


def assert_close_step(
    eager: tuple[torch.Tensor, AdamState], ours: tuple[torch.Tensor, AdamState], before: torch.Tensor,
    lr: float,
) -> None:  # fmt: skip
    """One step of the one kernel (``ours``) against the eager step from the same state, within
    the tolerance of [Note: One kernel on a GPU] (``tests/test_compact_kernel.py`` states it);
    any device."""
    (pe, se), (pk, sk) = eager, ours
    assert torch.equal(se.step, sk.step)
    nan = torch.isnan(pe)
    assert torch.equal(nan, torch.isnan(pk))
    fin = ~nan
    bound = 4 * _ulps(torch.maximum(before.abs(), torch.full_like(before, lr)))
    assert bool(((pe - pk).abs()[fin] <= bound[fin]).all())
    for (name, a), (_, b) in zip(se.moments(), sk.moments(), strict=True):
        assert isinstance(a, CompactTensor) and isinstance(b, CompactTensor), name
        sa, sb = a.scales, b.scales
        assert torch.equal(torch.isnan(sa), torch.isnan(sb)), name
        ok = ~torch.isnan(sa)
        # the signed extreme may be the other one where the two are within an ulp
        assert bool(((sa.abs() - sb.abs()).abs()[ok] <= 4 * _ulps(sa)[ok]).all()), name
        da, db = a.dequantize().view(-1), b.dequantize().view(-1)
        block = a.fmt.block
        scale = torch.maximum(sa.abs(), sb.abs()).repeat_interleave(block)[: da.numel()]
        gap = (2 * a.fmt.qmap.max_error + 2.0**-20) * scale
        real = ~torch.isnan(da)
        assert bool(((da - db).abs()[real] <= gap[real]).all()), name
        if da.numel() >= 4096:  # a code off by one is rare, not the rule
            assert (a.codes != b.codes).float().mean().item() < 0.01, name
