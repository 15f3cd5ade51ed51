"""Multi-rank (Gloo) tests: check_consistent, and parity with fairscale OSS / torch ZeRO."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from shardkit.partition import ParamSpec, check_consistent, partition
from shardkit.testing import world


def _model_params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 8),
        torch.nn.Linear(8, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 16),
        torch.nn.Linear(16, 4),
    )
    return list(model.parameters())


@world(2)
def test_consistent_inputs_pass() -> None:
    params = _model_params()
    check_consistent(params)
    check_consistent(partition(params, 2, algorithm="balanced"))
    check_consistent([ParamSpec.from_tensor(p) for p in params], group=dist.group.WORLD)


@world(2)
def test_permuted_params_raise_on_every_rank() -> None:
    params = _model_params()
    if dist.get_rank() == 1:
        params[1], params[5] = params[5], params[1]  # linear weights of different shapes
    with pytest.raises(ValueError) as info:
        check_consistent(params)
    msg = str(info.value)
    assert "first at index 1" in msg
    assert "rank 0 has ((16, 8), 'float32', 'trainable')" in msg
    assert "rank 1 has ((16, 16), 'float32', 'trainable')" in msg
    # The same holds for partitions built from the permuted lists.
    with pytest.raises(ValueError, match="first at index 1"):
        check_consistent(partition(params, 2))
    # The group is still usable afterwards: nobody is stuck in a collective.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0


@world(3)
def test_count_trainability_and_dtype_differences_name_the_ranks() -> None:
    rank = dist.get_rank()
    params = _model_params()
    if rank == 2:
        params = params[:-1]  # one parameter fewer
    with pytest.raises(ValueError) as info:
        check_consistent(params)
    msg = str(info.value)
    assert "first at index 8" in msg and "rank 2 has <missing>" in msg
    assert "ranks 0, 1 have 9" in msg and "rank 2 has 8" in msg

    specs = [ParamSpec.from_tensor(p) for p in _model_params()]
    if rank == 1:
        specs[4] = ParamSpec(specs[4].shape, specs[4].dtype, False)
    with pytest.raises(ValueError, match=r"first at index 4: ranks 0, 2 have .*'trainable'.*rank 1 has .*'frozen'"):
        check_consistent(specs)

    specs = [ParamSpec.from_tensor(p) for p in _model_params()]
    if rank == 0:
        specs[0] = ParamSpec(specs[0].shape, torch.bfloat16, True)
    with pytest.raises(ValueError, match=r"first at index 0: rank 0 has .*bfloat16"):
        check_consistent(specs)


@world(2)
def test_different_partition_settings_and_bad_input_raise_everywhere() -> None:
    rank = dist.get_rank()
    params = _model_params()
    algo = "greedy" if rank == 0 else "balanced"
    with pytest.raises(ValueError, match="disagree on the partition itself"):
        check_consistent(partition(params, 2, algorithm=algo))
    # Same algorithm, different costs -> same specs but different owners.
    costs = [1.0] * len(params) if rank == 0 else [float(p.numel()) for p in params]
    with pytest.raises(ValueError, match="owned by rank"):
        check_consistent(partition(params, 2, costs=costs))
    # One rank passes garbage: it gets its own error, the other rank is told which rank.
    bad: object = 42 if rank == 1 else params
    with pytest.raises(ValueError, match=r"invalid input on 1 rank\(s\): rank 1: TypeError"):
        check_consistent(bad, timeout=timedelta(seconds=30))  # type: ignore[arg-type]
    # A partition for the wrong world size is reported on every rank.
    with pytest.raises(ValueError, match="world_size 4 but the group has 2 ranks"):
        check_consistent(partition(params, 4))


@world(2)
def test_subgroup() -> None:
    group = dist.new_group([0, 1])
    try:
        params = _model_params()
        check_consistent(params, group)
        if dist.get_rank() == 0:
            params = params[::-1]
        with pytest.raises(ValueError, match=r"rank 0 \(global 0\)"):
            check_consistent(params, group)
    finally:
        dist.destroy_process_group(group)


def _index_lists(per_rank: list[list[dict]], params: list[torch.nn.Parameter]) -> tuple[int, ...]:
    ids = {id(p): i for i, p in enumerate(params)}
    owner = [-1] * len(params)
    for rank, groups in enumerate(per_rank):
        for g in groups:
            for p in g["params"]:
                owner[ids[id(p)]] = rank
    return tuple(owner)


@world(3)
def test_parity_with_fairscale_oss_and_torch_zero() -> None:
    from fairscale.optim import OSS
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = _model_params()
    params += [torch.nn.Parameter(torch.zeros(37), requires_grad=False)]
    params += [torch.nn.Parameter(torch.zeros(n)) for n in (200, 3, 200, 64, 64, 1)]
    groups = [{"params": params[:6]}, {"params": params[6:], "lr": 0.5}]
    sizes = [6, len(params) - 6]

    oss = OSS(groups, optim=torch.optim.SGD, lr=0.1)
    theirs = _index_lists(oss.partition_parameters(), params)
    numel = [float(p.numel()) if p.requires_grad else 1.0 for p in params]
    ours = partition(params, 3, algorithm="greedy", costs=numel)
    assert ours.assignment == theirs

    trainable = [p for p in params if p.requires_grad]
    zgroups = [{"params": trainable[:6]}, {"params": trainable[6:], "lr": 0.5}]
    zero = ZeroRedundancyOptimizer(zgroups, optimizer_class=torch.optim.SGD, lr=0.1)
    theirs = _index_lists(zero._partition_parameters(), trainable)
    ours = partition(
        trainable,
        3,
        algorithm="sorted_greedy",
        costs=[float(p.numel()) for p in trainable],
        group_sizes=[6, len(trainable) - 6],
    )
    assert ours.assignment == theirs
    del sizes
