"""DDP's semantics for unused params and accumulation, in all three sharded modes (issue 29).

Each mode trains against torch DDP (``find_unused_parameters=True``) + the same torch
optimizer, from the same weights, on the same per-rank batches, at world 2, and must match it
bit for bit after every step (params) and at the end (the full optimizer state, step counts
included):

- ``zero1_ddp``: ``ShardedOptimizer`` stepping a DDP model;
- ``zero1_overlap``: the same, stepped by the shardkit-overlap comm hook inside backward;
- ``zero2``: ``ShardedDataParallel`` (sharded gradients; a small bucket cap, so params straddle
  the ranks' ranges and are stepped as pieces);
- ``zero2_views``: the same with ``gradient_as_bucket_view=True`` (backward accumulates into
  the staging buffers; the no_sync gradient and the first of each backward are still copied);
- ``zero2_sync``: ``zero2`` with ``overlap_param_gather=False`` (the default, ``zero2``, leaves
  the param gathers to the next forward, behind the param-access guard).

Over the full product of

- optimizers: SGD, SGD + momentum + weight decay, Adam, AdamW (weight decay);
- unused patterns of a branch module: ``none`` (always used), ``some`` (rank 0 only: DDP gives
  it the average of rank 0's gradient and nothing), ``every`` (used at step 0 only, then by no
  rank: DDP leaves ``.grad`` ``None`` and the optimizer skips it, so momentum, Adam's moments,
  weight decay and the step count must not move it), ``alternating`` (every other step);
- backward patterns: ``one``, ``two`` synchronised backwards per step (gradients accumulate as
  avg(g1) + avg(g2)), and ``no_sync`` (a local backward under ``no_sync()``, then a
  synchronised one).

Why bit for bit: at world 2 a sum of two values does not depend on the order, every mode scales
each gradient by 1/2 before summing as DDP does, and the element-wise optimizers compute each
element from the same inputs whether they step a param, a flat range or a piece of it. Two
exceptions, by construction:

- ``zero2`` with two synchronised backwards: DDP reduces ``(avg(g1) + g2_r) / 2`` over the
  ranks (the second backward accumulates into the all-reduced ``.grad``), ZeRO-2 adds
  ``avg(g2)`` to the reduced shard (no rank holds ``avg(g1)`` in full); the same sum, rounded
  differently in the last bit, so those params are compared with rtol=1e-5, atol=1e-6;
- ``zero1_overlap`` with two synchronised backwards: the hook steps inside each backward, so the
  second synchronised backward before ``step()`` must raise on every rank (and moves nothing).
"""

from __future__ import annotations

import copy
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

_OPTIMS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "sgd_momentum_wd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}
_USE: dict[str, Callable[[int, int], bool]] = {
    "none": lambda step, rank: True,
    "some": lambda step, rank: rank == 0,
    "every": lambda step, rank: step == 0,
    "alternating": lambda step, rank: step % 2 == 0,
}
_BACKWARDS = ("one", "two", "no_sync")
_STEPS = 4


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 9)
        self.extra = nn.Linear(9, 9)  # the branch whose use follows the pattern
        self.head = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def _batch(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * k + dist.get_rank())
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


class _Mode:
    """One sharded training set-up over a copy of the reference weights."""

    def __init__(
        self, mode: str, net: _Net, cls: type[torch.optim.Optimizer], kw: Any, cap: int = 40
    ) -> None:
        self.mode = mode
        self.net = net
        self.opt = ShardedOptimizer(net.parameters(), optim=cls, **kw)
        self.overlap: Any = None
        self.sdp: ShardedDataParallel | None = None
        if mode.startswith("zero2"):
            self.sdp = ShardedDataParallel(
                net,
                self.opt,
                reduce_buffer_size=cap,
                gradient_as_bucket_view=mode == "zero2_views",
                overlap_param_gather=mode != "zero2_sync",
            )
            self.model: nn.Module = self.sdp
        else:
            self.model = DDP(net, find_unused_parameters=True)
            if mode == "zero1_overlap":
                self.overlap = register_zero_overlap(self.model, self.opt)  # type: ignore[arg-type]

    def no_sync(self) -> Any:
        return self.model.no_sync()  # type: ignore[operator]

    def step(self) -> None:
        (self.overlap or self.opt).step()
        self.opt.zero_grad()

    def full_state(self) -> dict[str, Any]:
        if self.sdp is not None:
            return self.sdp.optimizer_state_dict()
        self.opt.consolidate_state_dict(recipient_rank=-1)
        return self.opt.state_dict()


def _run(mode: str, optim: str, pattern: str, backwards: str) -> None:
    cls, kw = _OPTIMS[optim]
    torch.manual_seed(0)
    ref_net = _Net()
    got = _Mode(mode, copy.deepcopy(ref_net), cls, kw)
    ref = DDP(ref_net, find_unused_parameters=True)
    ref_opt = cls(ref_net.parameters(), **kw)
    use = _USE[pattern]
    rank = dist.get_rank()
    what = f"{mode}/{optim}/{pattern}/{backwards}"
    if mode == "zero1_overlap" and backwards == "two":
        _expect_second_backward_refused(got, ref_net)
        return
    exact = not (mode.startswith("zero2") and backwards == "two")
    for step in range(_STEPS):
        flag = use(step, rank)
        for model, no_sync in ((ref, ref.no_sync), (got.model, got.no_sync)):
            if backwards == "no_sync":
                x, y = _batch(step, 1)
                with no_sync():
                    nn.functional.mse_loss(model(x, flag), y).backward()
            for k in range(2 if backwards == "two" else 1):
                x, y = _batch(step, k)
                nn.functional.mse_loss(model(x, flag), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got.step()
        # the wrapper's parameters(): ZeRO-2's waits for the param gathers still in flight
        for (name, a), b in zip(ref_net.named_parameters(), got.model.parameters(), strict=True):
            _same(a, b, exact, f"{what} step {step}: {name}")
    full = got.full_state()
    want, have = ref_opt.state_dict()["state"], full["state"]
    assert sorted(want) == sorted(have), f"{what}: state of params {sorted(want)} vs {sorted(have)}"
    for i, st in want.items():
        assert sorted(st) == sorted(have[i]), f"{what}: param {i} state keys"
        for k, v in st.items():
            _same(torch.as_tensor(v), torch.as_tensor(have[i][k]), exact, f"{what}: param {i} {k}")
    if mode.startswith("zero2"):  # params stepped different numbers of times reload into other pieces
        again = _Mode(mode, copy.deepcopy(got.net), cls, kw, cap=23)
        assert again.sdp is not None
        again.sdp.load_optimizer_state_dict(full)
        for i, st in again.full_state()["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(have[i][k])), (what, i, k)


def _same(want: torch.Tensor, have: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(want, have), f"{what}: differs by {(want - have).abs().max().item()}"
    else:
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _expect_second_backward_refused(got: _Mode, ref_net: _Net) -> None:
    before = [p.detach().clone() for p in got.model.parameters()]
    x, y = _batch(0, 0)
    nn.functional.mse_loss(got.model(x, True), y).backward()
    got.step()  # one synchronised backward per step: fine
    stepped = [p.detach().clone() for p in got.model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, stepped, strict=True))
    nn.functional.mse_loss(got.model(x, True), y).backward()
    with pytest.raises(RuntimeError, match=r"second synchronised backward before optimizer\.step"):
        nn.functional.mse_loss(got.model(x, True), y).backward()
    del ref_net


@pytest.mark.parametrize("mode", ["zero1_ddp", "zero1_overlap", "zero2", "zero2_sync", "zero2_views"])
@world(2, timeout=300)
def test_unused_params_and_accumulation_match_ddp(mode: str) -> None:
    for optim, pattern, backwards in itertools.product(_OPTIMS, _USE, _BACKWARDS):
        _run(mode, optim, pattern, backwards)
