"""``Zero2Engine``, the public face of the ZeRO-2 engine ([Note: One engine, one adapter] in
``shardkit.optim._engine``): driven here by a minimal module adapter written against the public
API only (what shardkit-ddp does), at world 2 over Gloo, against a plain optimizer stepped on
the averaged gradients (to 1e-6: the reference sums in another order); and its public
surface, the contract a module adapter's version range on shardkit-optim promises.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import (
    CommStats,
    EngineOptions,
    ShardedOptimizer,
    Zero2Engine,
    build_flat_buckets,
    is_elementwise,
)
from shardkit.optim._lifecycle import GroupState
from shardkit.testing import world
from torch import nn

_SURFACE = {
    "attach": "(self) -> 'None'",
    "before_forward": "(self, module: 'nn.Module') -> 'None'",
    "broadcast": "(self, t: 'torch.Tensor', src_group_rank: 'int') -> 'None'",
    "buckets": "property",
    "clip_grad_norm": "(self, max_norm: 'float', norm_type: 'float') -> 'torch.Tensor'",
    "close": "(self) -> 'None'",
    "enter_no_sync": "(self) -> 'None'",
    "forward_started": "(self) -> 'None'",
    "full_state_dict": "(self, k: 'int') -> 'dict[str, Any]'",
    "has_reduced_grads": "(self) -> 'bool'",
    "in_backward": "property",
    "last_closure_loss": "property",
    "lay_out": (
        "(self, per_optimizer: 'Sequence[list[FlatBucket]]', module: 'nn.Module') -> 'None'"
    ),
    "load_full_state_dict": "(self, k: 'int', state_dict: 'dict[str, Any]') -> 'None'",
    "memory_bytes": "(self) -> 'Mapping[str, int]'",
    "reduce": "(self) -> 'None'",
    "refuse_graph_grads": "(self) -> 'None'",
    "set_sync": "(self, enabled: 'bool') -> 'None'",
    "stats": "property",
    "trainable_changed": "(self, params: 'Iterable[torch.Tensor]') -> 'bool'",
    "wait_params": "(self) -> 'None'",
    "zero_grad": "(self, params: 'Any', set_to_none: 'bool') -> 'None'",
}
"""What a module adapter may call (besides the attributes the constructor documents): a change
here is a change of shardkit-optim's public API (a minor release before 1.0)."""


def test_the_public_surface_is_what_the_adapter_needs() -> None:
    members = {
        name: "property" if isinstance(member, property) else str(inspect.signature(member))
        for name, member in vars(Zero2Engine).items()
        if not name.startswith("_")
    }
    assert members == _SURFACE
    assert str(inspect.signature(Zero2Engine)) == (
        "(optimizers: 'Sequence[ShardedOptimizer]', options: 'EngineOptions') -> 'None'"
    )


def test_options_are_checked() -> None:
    with pytest.raises(TypeError, match="overlap_param_gather must be a bool, got str"):
        EngineOptions(overlap_param_gather="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"wire_dtype must be None or a torch\.dtype"):
        EngineOptions(wire_dtype="bf16")  # type: ignore[arg-type]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def _adapt(model: nn.Module, opt: ShardedOptimizer) -> Zero2Engine:
    """The smallest module adapter: plan, lay out, attach, one forward pre-hook per module."""
    engine = Zero2Engine([opt], EngineOptions())
    flags = [is_elementwise(type(opt.optim), None)] * len(opt.param_groups)
    buckets, _ = build_flat_buckets(opt.param_groups, flags, dist.get_world_size(), 256, 256)
    engine.lay_out([buckets], model)
    engine.attach()
    for sub in model.modules():
        sub.register_forward_pre_hook(lambda m, args: engine.before_forward(m))
    return engine


@world(2)
def test_a_minimal_adapter_trains_like_the_averaged_reference() -> None:
    rank = dist.get_rank()
    model, ref = _net(), _net()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    engine = _adapt(model, opt)
    group = engine.groups[0]
    for step in range(3):
        engine.forward_started()
        engine.refuse_graph_grads()  # placeholders from the last backward are skipped unread
        model(_batch(step, rank)).square().sum().backward()
        assert not engine.in_backward and engine.has_reduced_grads()
        opt.step()
        assert group.state in (GroupState.GATHERING, GroupState.IDLE)
        opt.zero_grad()
        ref_opt.zero_grad()
        for r in range(2):  # the reference: the mean of both ranks' gradients
            (ref(_batch(step, r)).square().sum() * 0.5).backward()
        ref_opt.step()
    engine.wait_params()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert isinstance(engine.stats, CommStats) and engine.stats.calls["reduce_scatter"] > 0
    assert engine.memory_bytes()["grads"] > 0


@world(2)
def test_a_grad_that_requires_grad_is_refused_before_the_forward() -> None:
    """A ``no_sync()`` backward with ``create_graph=True`` leaves a ``.grad`` with a graph:
    the engine reduces detached gradients, so the adapter's next training forward raises."""
    model = _net()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    engine = _adapt(model, opt)
    engine.set_sync(False)
    model(_batch(0, dist.get_rank())).square().sum().backward(create_graph=True)
    engine.set_sync(True)
    with pytest.raises(RuntimeError, match=r"has a \.grad that requires grad .*create_graph"):
        engine.refuse_graph_grads()
    opt.zero_grad(set_to_none=True)
    engine.refuse_graph_grads()
    engine.close()
