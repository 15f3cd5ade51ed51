"""Any parameter shape round-trips through every checkpoint path (issue 26, item 1).

A property test over param shapes (``()``, ``(1,)``, ``(1, 1)``, zero-size, fewer elements than
ranks, ordinary), optimizers (SGD with momentum, Adam, AdamW), ZeRO-1 (``ShardedOptimizer``) and
ZeRO-2 (``ShardedDataParallel``) at world 1, 2 and 3: ``save_sharded`` / ``load_sharded``,
``load_consolidated`` and DCP's ``get_state_dict`` / ``set_state_dict`` give back the saved
state bit for bit. The world size is fixed per test; hypothesis draws the rest inside the rank
body, derandomized and without shrinking, so every rank draws the same examples in lockstep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _optim_testkit import assert_state_equal
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from shardkit.optim import ShardedOptimizer, load_consolidated, load_sharded, save_sharded
from shardkit.testing import world
from torch import nn

_SHAPES = [(), (1,), (1, 1), (0,), (2, 0), (2,), (3, 1), (4, 3)]
_OPTIMS: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99)}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


class _Params(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in shapes])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.sum() * 0
        for i, p in enumerate(self.ps):
            total = total + ((p - i * x.mean()) ** 2).sum()
        return total


def _build(
    shapes: list[tuple[int, ...]], name: str, zero2: bool
) -> tuple[Any, ShardedOptimizer, nn.Module]:
    model = _Params(shapes)
    cls, kw = _OPTIMS[name]
    opt = ShardedOptimizer(model.parameters(), optim=cls, **kw)
    if zero2:
        from shardkit.ddp import ShardedDataParallel

        return ShardedDataParallel(model, opt, reduce_buffer_size=64), opt, model
    return model, opt, model


def _train(wrapped: Any, model: nn.Module, opt: ShardedOptimizer, zero2: bool) -> None:
    for step in range(2):
        x = torch.randn(5, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        wrapped(x).backward()
        if not zero2:  # ZeRO-1 under plain data parallelism: average the grads
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(dist.get_world_size())
        opt.step()


def _roundtrip(shapes: list[tuple[int, ...]], name: str, zero2: bool, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    wrapped, opt, model = _build(shapes, name, zero2)
    _train(wrapped, model, opt, zero2)
    save_sharded(opt, path)
    want = opt.state_dict(all_ranks=True)
    # sharded
    _, opt2, model2 = _build(shapes, name, zero2)
    model2.load_state_dict(model.state_dict())
    load_sharded(opt2, path)
    # DCP's state-dict API on the loaded optimizer (every rank), into a third one
    msd, osd = get_state_dict(model2, opt2)
    _, opt3, model3 = _build(shapes, name, zero2)
    set_state_dict(model3, opt3, model_state_dict=msd, optim_state_dict=osd)
    assert_state_equal(want, opt2.state_dict(all_ranks=True))
    assert_state_equal(want, opt3.state_dict(all_ranks=True))
    # consolidated, offline
    if dist.get_rank() == 0:
        assert_state_equal(want, load_consolidated(path))
    dist.barrier()


_CASES = st.tuples(
    st.lists(st.sampled_from(_SHAPES), min_size=1, max_size=4),
    st.sampled_from(sorted(_OPTIMS)),
    st.booleans(),
)


def _property(tmp_path: Path, examples: int) -> None:
    counter = iter(range(1000))

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: ranks stay in lockstep
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_CASES)
    def check(case: tuple[list[tuple[int, ...]], str, bool]) -> None:
        shapes, name, zero2 = case
        _roundtrip(shapes, name, zero2, tmp_path / f"ckpt{next(counter)}")

    # the shapes of the issue always, whatever hypothesis draws
    for zero2 in (False, True):
        _roundtrip([(4, 1), (1,), (), (1, 1), (0,)], "adam", zero2, tmp_path / f"fixed{zero2}")
    check()


@world(1, timeout=300)
def test_any_shape_round_trips_world1(tmp_path: Path) -> None:
    _property(tmp_path, 3)


@world(2, timeout=300)
def test_any_shape_round_trips_world2(tmp_path: Path) -> None:
    _property(tmp_path, 4)


@world(3, timeout=300)
def test_any_shape_round_trips_world3(tmp_path: Path) -> None:
    _property(tmp_path, 3)
