"""The owner of each wrapped optimizer's buckets ([Note: Bucket group state] in
``shardkit.optim._bucket_group``) and the wrapper's options as data (``ShardedDataParallelConfig``).

The state is checked through a whole cycle with the paths that change it: ``no_sync()``
accumulation, two synchronised backwards before one step, the deferred param gathers, two
optimizers stepped one at a time, ``zero_grad``; the config through both ways of passing it.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel, ShardedDataParallelConfig
from shardkit.optim import EngineOptions, ShardedOptimizer
from shardkit.optim._lifecycle import BucketPhase, GroupState
from shardkit.testing import world
from torch import nn


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _loss(sdp: ShardedDataParallel, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return sdp(torch.randn(2, 4, generator=g)).pow(2).sum()


@world(2)
def test_the_group_state_follows_the_step_cycle() -> None:
    m = _net()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
    (group,) = sdp._engine.groups
    assert opt.driver is group and group.state is GroupState.IDLE
    with sdp.no_sync():
        _loss(sdp, 0).backward()
    assert group.state is GroupState.IDLE  # accumulated in .grad, nothing reduced
    _loss(sdp, 1).backward()  # reduces the no_sync() sum too
    sdp.wait_params()
    group.reducer.finish_all()
    assert group.state is GroupState.REDUCED and group.has_reduced_grads()
    _loss(sdp, 2).backward()  # a second synchronised backward adds into the shards
    group.reducer.finish_all()
    assert group.state is GroupState.REDUCED
    opt.step()  # ShardedOptimizer.step -> BucketGroup.step: one hop
    assert group.state is GroupState.GATHERING and group.gather.pending
    assert not group.has_reduced_grads()
    sdp.wait_params()
    assert group.state is GroupState.IDLE and not group.gather.pending
    _loss(sdp, 3).backward()
    opt.zero_grad()
    assert group.state is GroupState.IDLE and not group.has_reduced_grads()
    assert all(p.grad is None for p in m.parameters())


@world(2)
def test_two_optimizers_have_one_group_each_stepped_alone() -> None:
    m = _net()
    opt0 = ShardedOptimizer(m[0].parameters(), optim=torch.optim.SGD, lr=0.1)
    opt1 = ShardedOptimizer(m[2].parameters(), optim=torch.optim.Adam, lr=0.1)
    sdp = ShardedDataParallel(m, [opt0, opt1], reduce_buffer_size=0)
    g0, g1 = sdp._engine.groups
    assert (opt0.driver, opt1.driver) == (g0, g1)
    # one param map over every group: each param in exactly one (group, bucket, position)
    assert sdp._engine.reducer.groups == [g0, g1]
    where = sdp._engine.reducer.where
    assert {id(p) for p in m.parameters()} == set(where)
    assert all(where[id(p)][0] == 0 for p in m[0].parameters()) and where is g1.where
    _loss(sdp, 0).backward()
    opt1.step()
    assert g1.state is GroupState.GATHERING and not g1.has_reduced_grads()
    assert g0.state is GroupState.REDUCED and g0.has_reduced_grads()  # waits for opt0.step()
    opt0.step()
    sdp.wait_params()
    assert g0.state is g1.state is GroupState.IDLE


@world(2)
def test_options_as_a_config() -> None:
    m = _net()
    config = ShardedDataParallelConfig(reduce_fp16=True, overlap_param_gather=False)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, config=config)
    assert sdp.ddp_config is config and sdp.reduce_dtype == torch.float16
    assert not sdp.overlap_param_gather
    # the engine gets the options it needs, resolved (reduce_fp16 -> wire_dtype)
    assert sdp._engine.groups[0].config == EngineOptions(
        wire_dtype=torch.float16, overlap_param_gather=False
    )
    m.config = "the model's own"  # e.g. a Hugging Face model's: still reached through sdp
    assert sdp.config == "the model's own"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bucket_cap_mb = 1.0  # type: ignore[misc]
    m2 = _net()
    kwargs = ShardedDataParallel(
        m2,
        ShardedOptimizer(m2.parameters(), optim=torch.optim.SGD, lr=0.1),
        broadcast_buffers=False,
        bucket_cap_mb=0.5,
    )
    assert kwargs.ddp_config == ShardedDataParallelConfig(
        broadcast_buffers=False, bucket_cap_mb=0.5
    )
    assert kwargs.ddp_config.cap_bytes == 1 << 19 and kwargs.ddp_config.first_cap_bytes == 1 << 19


def test_config_validates_in_one_place() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        ShardedDataParallelConfig(bucket_cap_mb=0)
    with pytest.raises(TypeError, match="overlap_param_gather must be a bool"):
        ShardedDataParallelConfig(overlap_param_gather=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reduce_fp16=True means reduce_dtype=torch\.float16"):
        ShardedDataParallelConfig(reduce_fp16=True, reduce_dtype=torch.bfloat16)
    assert ShardedDataParallelConfig(reduce_buffer_size=0).cap_bytes == 1


@world(2)
def test_config_and_keyword_options_together_are_refused() -> None:
    m = _net()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"either as keyword arguments or as config="):
        ShardedDataParallel(m, opt, reduce_fp16=True, config=ShardedDataParallelConfig())
    with pytest.raises(TypeError, match="config must be a ShardedDataParallelConfig"):
        ShardedDataParallel(m, opt, config={"reduce_fp16": True})  # type: ignore[arg-type]


@world(2)
def test_one_step_walks_the_state_machine_and_illegal_calls_raise() -> None:
    m = _net()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)  # one bucket per param: 4
    (group,) = sdp._engine.groups
    life = group.life
    n = len(group.buckets)
    assert n == 4
    life.record = record = []
    _loss(sdp, 0).backward()
    opt.step()
    _loss(sdp, 1)  # the next forward waits for the gathers
    calls = [c for c, _, _ in record]
    assert calls.count("launch") == calls.count("finish") == n, calls
    assert calls.count("gather_issued") == calls.count("gather_done") == n, calls
    # every transition starts where the previous one ended
    assert all(a[2] is b[1] for a, b in itertools.pairwise(record)), record
    # the states the group went through, each change once, in the documented order
    changes = [(c, a, b) for c, a, b in record if a is not b]
    S = GroupState
    assert [(a, b) for _, a, b in changes] == [
        (S.IDLE, S.REDUCING),
        (S.REDUCING, S.REDUCED),
        (S.REDUCED, S.STEPPED),
        (S.STEPPED, S.GATHERING),
        (S.GATHERING, S.IDLE),
    ], changes
    assert [c for c, _, _ in changes] == [
        "launch", "finish", "stepped", "step_done", "gather_done"
    ]  # fmt: skip
    assert calls[0] == "begin_pass" and calls[-1] == "gather_done"
    assert all(b.phase is BucketPhase.IDLE and not b.pending for b in life.buckets)
    # illegal transitions name the call and the state, and change nothing
    with pytest.raises(RuntimeError, match=r"illegal transition finish\(\) in state IDLE"):
        life.finish(0)
    with pytest.raises(RuntimeError, match=r"step_done\(\) in state IDLE: no step is running"):
        life.step_done()
    with pytest.raises(RuntimeError, match=r"gather_done\(\) in state IDLE"):
        life.gather_done(group.buckets[0].index)
    with pytest.raises(RuntimeError, match=r"stage\(\) in state IDLE: bucket .* is IDLE"):
        life.stage(0, 0, real=True)
    assert group.state is GroupState.IDLE and not group.has_reduced_grads()
