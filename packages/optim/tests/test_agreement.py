"""Rank disagreements raise on every rank, never hang or train silently.

See [Note: Per-step agreement] and [Note: Param order fingerprint]. Each test runs with a
60 s limit: a hang fails it instead of waiting for the process group's timeout.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _optim_testkit import train
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


@world(2, timeout=60)
def test_different_hyperparameters_at_construction() -> None:
    lr = 0.01 if dist.get_rank() == 0 else 0.02
    with pytest.raises(ValueError, match=r"ranks disagree on .*hyper-parameter digest"):
        ShardedOptimizer(_model().parameters(), torch.optim.Adam, lr=lr)


@world(2, timeout=60)
def test_hyperparameters_changed_on_one_rank_between_steps() -> None:
    model = _model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    train(model, opt, 1, batch=6)
    if dist.get_rank() == 1:  # e.g. a schedule built from this rank's own loader length
        opt.param_groups[0]["lr"] = 0.005
    with pytest.raises(ValueError, match=r"lr=0\.01 on rank 0 but lr=0\.005 on rank 1"):
        train(model, opt, 1, start=1, batch=6)


@world(2, timeout=60)
def test_requires_grad_changed_on_one_rank() -> None:
    """The repartition every rank agrees to run then finds the masks differ: every rank raises."""
    model = _model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    train(model, opt, 1, batch=6)
    if dist.get_rank() == 0:
        model[2].requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad mask hash"), pytest.warns(UserWarning):
        train(model, opt, 1, start=1, batch=6)


@world(2, timeout=60)
def test_sparse_gradient_on_one_rank() -> None:
    model = _model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if dist.get_rank() == 1:
        w = model[0].weight
        w.grad = torch.zeros_like(w).to_sparse()
    with pytest.raises(TypeError, match=r"sparse gradient .* on rank 1"):
        opt.step()


@world(2, timeout=60)
def test_params_in_another_order_on_one_rank() -> None:
    """The biases of the first two layers have the same shape: rank 1 passes them swapped,
    which the shape/dtype check cannot see."""
    model = _model()
    params = list(model.parameters())
    if dist.get_rank() == 1:
        params[1], params[3] = params[3], params[1]
    with pytest.raises(ValueError, match=r"param 1 \(shape \(6,\)\) on rank 1 holds the values"):
        ShardedOptimizer(params, torch.optim.SGD, lr=0.1)


@world(1, timeout=60)
def test_the_order_fingerprint_makes_no_fp64_copy_of_a_param() -> None:
    """[Note: Param order fingerprint]: the fp64 sums run chunk by chunk, so the construction
    check over a 64 MiB param allocates no 128 MiB fp64 cast: the largest allocation inside any
    op it runs, as torch's profiler records them (``profile_memory``), is one chunk's 8 MiB
    (summed whole: 128 MiB; the resident set of a 256 MB param grew 514 MB that way)."""
    from shardkit.optim._agreement import check_param_order
    from torch.profiler import ProfilerActivity, profile

    big = nn.Parameter(torch.randn(16 * 2**20))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        check_param_order([big], dist.group.WORLD)
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert largest <= 8 * 2**20, largest


@world(2, timeout=60)
def test_differently_initialised_ranks_are_not_an_ordering_error() -> None:
    import shardkit.optim._agreement as agreement

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("shardkit.optim")
    logger.addHandler(handler)
    agreement._warned_values = False
    try:
        ShardedOptimizer(_model(seed=dist.get_rank()).parameters(), torch.optim.SGD, lr=0.1)
    finally:
        logger.removeHandler(handler)
    assert any("initialised differently" in r.getMessage() for r in records)


@world(2, timeout=60)
def test_different_max_grad_norm() -> None:
    model = _model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(ValueError, match=r"rank 0: \(1\.0, 2\.0\), rank 1: \(2\.0, 2\.0\)"):
        opt.clip_grad_norm(1.0 + dist.get_rank())


@world(2, timeout=60)
def test_collective_timeout_when_a_rank_skips_step() -> None:
    """Rank 1 never calls step(): rank 0 raises after the timeout instead of hanging."""
    group = dist.new_group([0, 1])  # a group of its own: the test leaves it unusable
    model = _model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, group=group, lr=0.1,
                           collective_timeout=2.0)  # fmt: skip
    if dist.get_rank() == 0:
        model(torch.randn(5, 4)).sum().backward()
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=r"called ShardedOptimizer.step\(\) and waited 0:00:02"
        ):
            opt.step()
        assert time.monotonic() - start < 30
    dist.barrier()  # the default group is still fine


def test_bad_collective_timeout() -> None:
    from shardkit.optim._args import check_timeout as _check_timeout

    for bad in (0, -1.0, "3", True):
        with pytest.raises(ValueError, match="collective_timeout must be a positive number"):
            _check_timeout(bad)
    assert _check_timeout(2).total_seconds() == 2.0  # type: ignore[union-attr]


# ---------------------------------------------------------------- call agreement (issue 26/29)
def _stepped_adam(collective_timeout: float) -> ShardedOptimizer:
    """A ShardedOptimizer(Adam) over a small Linear, stepped once (state exists)."""
    model = nn.Linear(4, 3)
    opt = ShardedOptimizer(
        model.parameters(),
        optim=torch.optim.Adam,
        lr=0.1,
        collective_timeout=collective_timeout,
    )
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt


@world(2, timeout=90)
def test_state_dict_on_one_rank_raises_on_every_rank_within_the_timeout() -> None:
    """The classic "save on rank 0 only": rank 0 raises after ``collective_timeout`` naming the
    call; rank 1, which trains on, raises at its next step naming both calls; the default
    process group stays usable."""
    opt = _stepped_adam(collective_timeout=2.0)
    if dist.get_rank() == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"state_dict\(\).*every\s+rank must call"):
            opt.state_dict()
        assert time.monotonic() - start < 20
    else:
        time.sleep(3)  # rank 0 has timed out by now
        with pytest.raises(RuntimeError, match=r"different collective calls.*state_dict"):
            opt.step()
    t = torch.ones(1)
    dist.all_reduce(t)  # the default group is still usable
    assert t.item() == 2.0


@world(2, timeout=90)
def test_ranks_in_different_calls_raise_the_same_error_before_anything_moves() -> None:
    model = nn.Linear(4, 3)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError,
        match=r"different collective calls.*consolidate_state_dict.*step|different collective calls.*step.*consolidate_state_dict",
    ):
        if dist.get_rank() == 0:
            opt.consolidate_state_dict(0)
        else:
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.optim.state  # no shard moved, no state created
    opt.step()  # and the ranks are back in step


@world(2, timeout=90)
def test_a_rank_that_skips_the_clip_makes_every_rank_raise_before_anything_moves() -> None:
    """ZeRO-1: rank 1 skips ``clip_grad_norm`` and steps; both ranks raise the same error naming
    both calls at once (not after the process group's timeout in the norm's all-gather), the
    gradients unscaled and no param moved; the next agreed calls work."""
    model = nn.Linear(4, 3)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    start = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"(?s)different collective calls.*(clip_grad_norm.*step|step.*clip_grad_norm)",
    ):
        if dist.get_rank() == 0:
            opt.clip_grad_norm(0.5)
        else:
            opt.step()
    assert time.monotonic() - start < 20
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    norm = opt.clip_grad_norm(0.5)  # every rank: agreed
    assert norm.item() > 0.5
    opt.step()


@world(2, timeout=90)
def test_save_sharded_on_one_rank_alone_raises_within_the_timeout(tmp_path: Path) -> None:
    from shardkit.optim import save_sharded

    opt = _stepped_adam(collective_timeout=2.0)
    if dist.get_rank() == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"save_sharded\(\) and waited"):
            save_sharded(opt, tmp_path / "ckpt")
        assert time.monotonic() - start < 20
        assert not (tmp_path / "ckpt").exists()  # nothing written
    else:
        time.sleep(3)
        with pytest.raises(RuntimeError, match=r"different collective calls.*save_sharded"):
            opt.step()


def test_registered_error_types_round_trip_by_name() -> None:
    """The agreement knows no checkpoint type: shardkit.optim's checkpoint layer registers
    shardkit.checkpoint's errors, which then come back with their type; an unregistered type
    becomes the caller's default; a second type of the same name is refused."""
    from shardkit.checkpoint import CheckpointNotFoundError, ChecksumError
    from shardkit.optim import register_error_type
    from shardkit.optim._agreement import agreed_error, outcome

    for cls in (ChecksumError, CheckpointNotFoundError):
        error = agreed_error([None, outcome(cls("bad"))], "op", template="{message}")
        assert type(error) is cls and str(error) == "bad"

    class Unknown(Exception):
        pass

    error = agreed_error([outcome(Unknown("x"))], "op", default=ValueError)
    assert type(error) is ValueError
    assert register_error_type(Unknown) is Unknown
    assert type(agreed_error([outcome(Unknown("x"))], "op")) is Unknown

    class ChecksumError(ValueError):  # another type named like a registered one
        pass

    with pytest.raises(ValueError, match="has the name of the registered"):
        register_error_type(ChecksumError)


def test_agreement_module_imports_no_checkpoint_type() -> None:
    """Issue 38: the agreement module does not know checkpoint types (they are registered).
    Issue 48: it takes the one outcome agreement from shardkit-checkpoint's public API, and
    nothing else of it."""
    import ast

    import shardkit.optim._agreement as agreement

    tree = ast.parse(Path(agreement.__file__).read_text())
    names = {
        (node.module or "", a.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }
    from_checkpoint = {n for m, n in names if "checkpoint" in m}
    assert all(m == "shardkit.checkpoint" for m, _ in names if "checkpoint" in m), names
    assert from_checkpoint <= {
        "REFUSED", "Outcome", "agree_outcome", "agreed_error", "outcome", "register_error_type"
    }, from_checkpoint  # fmt: skip
    assert not [n for n in from_checkpoint if n.endswith("Error")], from_checkpoint
