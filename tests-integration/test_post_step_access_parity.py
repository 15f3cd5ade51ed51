"""What users do with the model between ``optimizer.step()`` and the next forward gives DDP's
result in every sharded mode, with default settings (issue 35).

Each mode trains against torch DDP (``find_unused_parameters=True``) + the same torch optimizer,
from the same weights, on the same per-rank batches, at world 2, and after every ``step()`` both
sides do the same post-step access to the module they wrapped; the test compares, bit for bit,
everything the access observed, the params and the full optimizer state at the end:

- modes: ``zero1_ddp`` (``ShardedOptimizer`` + DDP), ``zero1_overlap`` (the shardkit-overlap comm
  hook), ``zero2`` (``ShardedDataParallel``, default: param gathers overlap the next forward,
  guarded), ``zero2_sync`` (``overlap_param_gather=False``), ``zero2_views``
  (``gradient_as_bucket_view=True``); ZeRO-2 with one bucket per param and with one bucket for
  all;
- post-step accesses: ``none``; ``averaged_model`` (``torch.optim.swa_utils.AveragedModel`` EMA,
  ``update_parameters``); ``captured_lerp`` (an EMA that captured ``list(model.parameters())``
  once and ``torch._foreach_lerp_`` s towards it); ``norm_log`` (each param's norm, ``.item()``);
  ``clamp`` (WGAN: ``p.clamp_(-c, c)`` in place on every param); ``load_state_dict`` (a
  submodule reloads weights saved two steps earlier); ``numpy`` (``p.detach().numpy()``);
  ``torch_save`` (``torch.save`` of each param, by a reference taken before training);
- in every forward, from step 2 on, a head whose module never runs is read functionally
  (``F.linear(h, aux.weight, aux.bias)``): a path no module pre-hook covers;
- optimizers: SGD + momentum + weight decay, AdamW.

Why bit for bit: at world 2 a sum of two values does not depend on the order, every mode scales
each gradient by 1/2 before summing as DDP does, and the element-wise optimizers compute each
element from the same inputs whether they step a param, a flat range or a piece of it.
"""

from __future__ import annotations

import copy
import io
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.overlap import register_zero_overlap
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

_OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd_momentum_wd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}
_STEPS = 5


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(12, 12)
        self.aux = nn.Linear(12, 3)  # never called as a module: read functionally from step 2
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        out = self.head(h)
        if step >= 2:
            out = out + nn.functional.linear(h, self.aux.weight, self.aux.bias)
        return out


class _Access:
    """One post-step access, done alike to the reference and to the sharded side."""

    def __init__(self, kind: str, net: _Net) -> None:
        self.kind = kind
        self.net = net
        self.params = list(net.parameters())  # captured once, as an EMA or a logger would
        self.seen: list[Any] = []
        self.ema = (
            AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
            if kind == "averaged_model"
            else None
        )
        self.shadow = [p.detach().clone() for p in self.params]
        self.saved_head: dict[str, torch.Tensor] = {}

    def after_step(self, step: int) -> None:
        kind = self.kind
        with torch.no_grad():
            if kind == "averaged_model":
                assert self.ema is not None
                self.ema.update_parameters(self.net)
            elif kind == "captured_lerp":
                torch._foreach_lerp_(self.shadow, self.params, 0.1)
            elif kind == "norm_log":
                self.seen.append([p.norm().item() for p in self.net.parameters()])
            elif kind == "clamp":
                for p in self.net.parameters():
                    p.clamp_(-0.08, 0.08)
            elif kind == "load_state_dict":
                if step % 2 == 0:
                    self.saved_head = copy.deepcopy(self.net.head.state_dict())
                else:
                    self.net.head.load_state_dict(self.saved_head)
            elif kind == "numpy":
                self.seen.append([p.detach().numpy().copy() for p in self.params])
            elif kind == "torch_save":
                buf = io.BytesIO()
                torch.save(self.params, buf)
                buf.seek(0)
                self.seen.append(torch.load(buf))

    def observed(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        if self.ema is not None:
            out += [p.detach() for p in self.ema.parameters()]
        if self.kind == "captured_lerp":
            out += self.shadow
        for row in self.seen:
            out += [torch.as_tensor(v) for v in row]
        return out


_MODES = ("zero1_ddp", "zero1_overlap", "zero2", "zero2_sync", "zero2_views")
_ACCESSES = (
    "none",
    "averaged_model",
    "captured_lerp",
    "norm_log",
    "clamp",
    "load_state_dict",
    "numpy",
    "torch_save",
)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _sharded(
    mode: str, net: _Net, cls: type[torch.optim.Optimizer], kw: Any, cap: int | None
) -> tuple[nn.Module, Callable[[], None], Callable[[], dict[str, Any]]]:
    opt = ShardedOptimizer(net.parameters(), optim=cls, **kw)
    if mode.startswith("zero2"):
        sdp = ShardedDataParallel(
            net,
            opt,
            reduce_buffer_size=cap,
            overlap_param_gather=mode != "zero2_sync",
            gradient_as_bucket_view=mode == "zero2_views",
        )

        def step() -> None:
            opt.step()
            opt.zero_grad()

        return sdp, step, sdp.optimizer_state_dict
    model = DDP(net, find_unused_parameters=True)
    hook: Any = register_zero_overlap(model, opt) if mode == "zero1_overlap" else None

    def step1() -> None:
        (hook or opt).step()
        opt.zero_grad()

    def full() -> dict[str, Any]:
        opt.consolidate_state_dict(recipient_rank=-1)
        return opt.state_dict()

    return model, step1, full


def _run(mode: str, optim: str, access: str, cap: int | None) -> None:
    cls, kw = _OPTIMS[optim]
    what = f"{mode}/{optim}/{access}/cap={cap}"
    torch.manual_seed(0)
    ref_net = _Net()
    net = copy.deepcopy(ref_net)
    ref = DDP(ref_net, find_unused_parameters=True)
    ref_opt = cls(ref_net.parameters(), **kw)
    model, step, full_state = _sharded(mode, net, cls, kw, cap)
    sides = [(_Access(access, ref_net), ref), (_Access(access, net), model)]
    for i in range(_STEPS):
        x, y = _batch(i)
        for k, (acc, m) in enumerate(sides):
            nn.functional.mse_loss(m(x, i), y).backward()
            if k == 0:
                ref_opt.step()
                ref_opt.zero_grad()
            else:
                step()
            acc.after_step(i)
    want, got = sides[0][0].observed(), sides[1][0].observed()
    assert len(want) == len(got), what
    for j, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"{what}: observed value {j} differs by {(a - b).abs().max()}"
    for (name, a), b in zip(ref_net.named_parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b), f"{what}: {name} differs by {(a - b).abs().max()}"
    have = full_state()["state"]
    for idx, st in ref_opt.state_dict()["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(have[idx][key])), (
                f"{what}: state {idx} {key}"
            )


@pytest.mark.parametrize("mode", _MODES)
@world(2, timeout=400)
def test_post_step_accesses_match_ddp(mode: str) -> None:
    caps: tuple[int | None, ...] = (0, None) if mode.startswith("zero2") else (None,)
    for optim, access, cap in itertools.product(_OPTIMS, _ACCESSES, caps):
        _run(mode, optim, access, cap)
