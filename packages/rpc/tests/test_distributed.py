"""Tier 2: multi-process RPC tests (TensorPipe over localhost).

Rank 0 (worker0) is the trainer; worker1 and worker2 own parameters. Every test body runs on all
three ranks of one RPC session shared by this module (the ``rpc_world`` fixture, see
[Note: One RPC session per world] in _rpc_world.py): torch cannot re-initialise RPC in a process,
so process start-up is paid once per module. Bodies use distinct tags for what they build.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from shardkit.rpc import DistributedOptimizer, RemoteOptimizerError
from shardkit.rpc._owner import _remote_step
from shardkit.rpc._torch_compat import is_unknown_context_error

# Per-process registry of owner-side modules / parameters built by the tests.
_MODULES: dict[str, torch.nn.Module] = {}
_EVENTS: list[tuple[str, float, float]] = []
_PATH = os.path.abspath(__file__)


def _build(name: str, fan_in: int, fan_out: int, seed: int) -> list[Any]:
    torch.manual_seed(seed)
    _MODULES[name] = torch.nn.Linear(fan_in, fan_out)
    return [rpc.RRef(p) for p in _MODULES[name].parameters()]


def _forward(name: str, x: torch.Tensor) -> torch.Tensor:
    return _MODULES[name](x)


def _snapshot(name: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in _MODULES[name].parameters()]


def _grads_are_none(name: str) -> bool:
    return all(p.grad is None for p in _MODULES[name].parameters())


def _param_rrefs(name: str) -> list[Any]:
    return [rpc.RRef(p) for p in _MODULES[name].parameters()]


def _not_a_tensor() -> list[int]:
    return [1, 2, 3]


def _events() -> list[tuple[str, float, float]]:
    return list(_EVENTS)


def _step_paths(opt: DistributedOptimizer) -> dict[str, str]:
    """Per owner, the call a step without option changes takes ("script" or "python")."""
    return {
        owner: "python" if call is _remote_step else "script"
        for owner, _, _, call, _ in opt._step_calls
    }


def _owner_group_option(handle: int, group: int, key: str) -> Any:
    from shardkit.rpc._local_optimizer import _lookup

    return _lookup(handle).optimizer.param_groups[group][key]


def _disable_script_step(disabled: bool) -> None:
    """Make this process behave as if TorchScript were unavailable (``_remote_new`` reports it,
    a trainer built meanwhile steps over Python calls); see [Note: Step requests]."""
    import shardkit.rpc._optimizer as trainer_side
    import shardkit.rpc._script_step as entry

    if disabled:
        _SAVED_SCRIPT_STEP.append(entry.script_step)
        entry.script_step = trainer_side.script_step = None
    else:
        entry.script_step = trainer_side.script_step = _SAVED_SCRIPT_STEP.pop()


_SAVED_SCRIPT_STEP: list[Any] = []


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_LOG_HANDLER = _ListHandler()


def _capture_logs(on: bool) -> list[tuple[int, str]]:
    """Start (``on``: forgetting what this process already logged once) or stop capturing this
    process's ``shardkit.rpc`` records; returns those captured since the start."""
    from shardkit.rpc import _logging

    log = logging.getLogger("shardkit.rpc")
    if on:
        _LOG_HANDLER.records.clear()
        with _logging._logged_lock:
            _logging._logged.clear()
        log.addHandler(_LOG_HANDLER)
        log.setLevel(logging.DEBUG)
        return []
    log.removeHandler(_LOG_HANDLER)
    log.setLevel(logging.NOTSET)
    return [(r.levelno, r.getMessage()) for r in _LOG_HANDLER.records]


class _Model:
    """Trainer-side handle: layer1 on ``owners[0]``, layer2 on ``owners[1]``, scale local."""

    def __init__(self, owners: tuple[str, str], tag: str, seed: int = 0) -> None:
        self.owners, self.tag = owners, tag
        self.l1 = rpc.rpc_sync(owners[0], _build, args=(f"{tag}1", 6, 5, seed))
        self.l2 = rpc.rpc_sync(owners[1], _build, args=(f"{tag}2", 5, 3, seed + 1))
        torch.manual_seed(seed + 2)
        self.scale = torch.nn.Parameter(torch.rand(3) + 0.5)

    def groups(self) -> list[dict[str, Any]]:
        return [
            {"params": self.l1, "lr": 0.05},
            {"params": [*self.l2, rpc.RRef(self.scale)]},
        ]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = rpc.rpc_sync(self.owners[0], _forward, args=(f"{self.tag}1", x)).tanh()
        out = rpc.rpc_sync(self.owners[1], _forward, args=(f"{self.tag}2", h)) * self.scale
        return ((out - y) ** 2).mean()

    def params(self) -> list[torch.Tensor]:
        return [
            *rpc.rpc_sync(self.owners[0], _snapshot, args=(f"{self.tag}1",)),
            *rpc.rpc_sync(self.owners[1], _snapshot, args=(f"{self.tag}2",)),
            self.scale.detach().clone(),
        ]


class _Reference(torch.nn.Module):
    """The same model in one process."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(6, 5)
        torch.manual_seed(seed + 1)
        self.l2 = torch.nn.Linear(5, 3)
        torch.manual_seed(seed + 2)
        self.scale = torch.nn.Parameter(torch.rand(3) + 0.5)

    def groups(self) -> list[dict[str, Any]]:
        return [
            {"params": list(self.l1.parameters()), "lr": 0.05},
            {"params": [*self.l2.parameters(), self.scale]},
        ]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.l2(self.l1(x).tanh()) * self.scale - y) ** 2).mean()

    def params(self) -> list[torch.Tensor]:
        return [
            *(p.detach().clone() for p in self.l1.parameters()),
            *(p.detach().clone() for p in self.l2.parameters()),
            self.scale.detach().clone(),
        ]


def _batches(n: int, seed: int = 100) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _dist_step(model: _Model, opt: DistributedOptimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [model.loss(x, y)])
        opt.step(cid)


def _local_step(
    model: _Reference, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    opt.zero_grad()
    model.loss(x, y).backward()
    opt.step()


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"{what}: tensor {i} differs by {(g - w).abs().max().item()}"


_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    "NAdam": (torch.optim.NAdam, {"lr": 0.01}),
    "RAdam": (torch.optim.RAdam, {"lr": 0.01}),
}


# -- parity -------------------------------------------------------------------------------------


def _body_parity_with_single_process(rank: int, opt_name: str) -> None:
    if rank != 0:
        return
    cls, kwargs = _OPTIMIZERS[opt_name]
    model, ref = _Model(("worker1", "worker2"), f"m{opt_name}"), _Reference()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = DistributedOptimizer(cls, model.groups(), **kwargs)
        ref_opt = cls(ref.groups(), **kwargs)
        _assert_same(model.params(), ref.params(), "initial parameters")
        for x, y in _batches(4):
            _dist_step(model, opt, x, y)
            _local_step(ref, ref_opt, x, y)
    assert [str(w.message) for w in caught] == []
    _assert_same(model.params(), ref.params(), f"{opt_name} after 4 steps")
    # Every owner (worker0 is one too) is stepped through the TorchScript entry point.
    assert _step_paths(opt) == dict.fromkeys(["worker1", "worker2", "worker0"], "script")
    assert opt.param_groups[0]["lr"] == 0.05
    assert opt.param_groups[1]["lr"] == kwargs["lr"]
    assert rpc.rpc_sync("worker1", _grads_are_none, args=(f"m{opt_name}1",))
    assert rpc.rpc_sync("worker2", _grads_are_none, args=(f"m{opt_name}2",))
    assert model.scale.grad is None


@pytest.mark.parametrize("opt_name", list(_OPTIMIZERS))
def test_parity_with_single_process(rpc_world: Any, opt_name: str) -> None:
    """Bit-for-bit equal to the same model and optimizer in one process (param groups,
    a trainer-owned parameter, two remote owners), with no warnings and no stale .grad."""
    rpc_world.run(_PATH, "_body_parity_with_single_process", opt_name)


def _body_python_step_path(rank: int) -> None:
    """Without TorchScript on the trainer, or on one owner, steps take the Python entry point
    for those owners: same bit-for-bit results."""
    if rank != 0:
        return
    cls, kwargs = _OPTIMIZERS["Adam"]
    # TorchScript unavailable on the trainer: every owner over the Python entry point.
    _disable_script_step(True)
    try:
        model, ref = _Model(("worker1", "worker2"), "pyt"), _Reference()
        opt = DistributedOptimizer(cls, model.groups(), **kwargs)
    finally:
        _disable_script_step(False)
    assert _step_paths(opt) == dict.fromkeys(["worker1", "worker2", "worker0"], "python")
    ref_opt = cls(ref.groups(), **kwargs)
    for x, y in _batches(4):
        _dist_step(model, opt, x, y)
        _local_step(ref, ref_opt, x, y)
    _assert_same(model.params(), ref.params(), "Python entry point, after 4 steps")

    # Unavailable on worker1 only (it reports so when it builds its optimizer); the trainer logs
    # that fallback once, not once per optimizer.
    rpc.rpc_sync("worker1", _disable_script_step, args=(True,))
    _capture_logs(True)
    try:
        model, ref = _Model(("worker1", "worker2"), "pyo"), _Reference()
        opt = DistributedOptimizer(cls, model.groups(), **kwargs)
        DistributedOptimizer(cls, model.groups(), **kwargs)
    finally:
        logged = _capture_logs(False)
        rpc.rpc_sync("worker1", _disable_script_step, args=(False,))
    assert len(logged) == 1, logged
    assert logged[0][0] == logging.INFO and "worker1 has no TorchScript step" in logged[0][1]
    assert "Python RPC calls" in logged[0][1], logged
    paths = {"worker1": "python", "worker2": "script", "worker0": "script"}
    assert _step_paths(opt) == paths
    ref_opt = cls(ref.groups(), **kwargs)
    for x, y in _batches(4):
        _dist_step(model, opt, x, y)
        _local_step(ref, ref_opt, x, y)
    _assert_same(model.params(), ref.params(), "mixed entry points, after 4 steps")


def test_python_step_path(rpc_world: Any) -> None:
    """The Python step entry point (no TorchScript on the trainer, or on one owner) gives the
    same bit-for-bit results as a single process."""
    rpc_world.run(_PATH, "_body_python_step_path")


def _body_option_changes_reach_the_owners(rank: int) -> None:
    if rank != 0:
        return
    # Adam's betas are a tuple and must arrive as one (Adam indexes and unpacks them).
    model, ref = _Model(("worker1", "worker2"), "upa"), _Reference()
    opt = DistributedOptimizer(torch.optim.Adam, model.groups(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.groups(), lr=0.01)
    batches = list(_batches(4))
    for i, (x, y) in enumerate(batches):
        if i == 2:
            for group in (opt.param_groups[0], ref_opt.param_groups[0]):
                group["betas"] = (0.8, 0.95)
                group["eps"] = 1e-6
        _dist_step(model, opt, x, y)
        _local_step(ref, ref_opt, x, y)
    handle = opt._remote["worker1"]
    betas = rpc.rpc_sync("worker1", _owner_group_option, args=(handle, 0, "betas"))
    assert type(betas) is tuple and betas == (0.8, 0.95), betas
    _assert_same(model.params(), ref.params(), "Adam with a betas change")

    # A tensor lr arrives as a tensor.
    model, ref = _Model(("worker1", "worker2"), "upt"), _Reference()
    opt = DistributedOptimizer(torch.optim.SGD, model.groups(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.groups(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        if i == 1:
            for group in (opt.param_groups[1], ref_opt.param_groups[1]):
                group["lr"] = torch.tensor(0.05)
        _dist_step(model, opt, x, y)
        _local_step(ref, ref_opt, x, y)
    lr = rpc.rpc_sync("worker2", _owner_group_option, args=(opt._remote["worker2"], 0, "lr"))
    assert isinstance(lr, torch.Tensor) and torch.equal(lr, torch.tensor(0.05)), lr
    assert (
        rpc.rpc_sync("worker1", _owner_group_option, args=(opt._remote["worker1"], 0, "lr")) == 0.05
    )
    _assert_same(model.params(), ref.params(), "SGD with a tensor lr")


def test_option_changes_reach_the_owners(rpc_world: Any) -> None:
    """Changed options travel with the next step as they are (a tuple betas, a tensor lr) and
    only to the owners holding that group; results match a local optimizer bit-for-bit."""
    rpc_world.run(_PATH, "_body_option_changes_reach_the_owners")


# -- concurrency --------------------------------------------------------------------------------


# [Note: Where torch's DistributedOptimizer loses updates]
# For the optimizers with a functional form (SGD, Adam, AdamW, Adagrad, RMSprop, Adadelta, Rprop,
# Adamax) torch's DistributedOptimizer scripts the local optimizer and steps it through a
# TorchScript function that runs without the GIL and takes no lock (`_ScriptLocalOptimizer.step`;
# only its Python fallback `_LocalOptimizer` holds a process-wide lock). Concurrent steps then
# race on the in-place parameter update: two RPC server threads read the same old value and one
# write wins. With a 4-element parameter the update takes nanoseconds and the race is hardly ever
# hit; with a parameter of 2**18+ elements the in-place add of concurrent steps overlaps and
# updates can go missing (measured on the 2-core CI machine, one trainer process, 8 threads x
# 50 steps: up to 1 update lost in 1 of 2 runs at 4096 elements, 3 in 1 of 2 at 2**18, 7-8 in 2
# of 2 at 2**20, none at 4 elements; with two trainer processes as below, none in 4 runs). The
# loss is probabilistic, so the test records torch's count (junit property `torch_lost_updates`)
# and asserts only shardkit's result, which is exact by construction (see
# [Note: Per-optimizer serial queue] in _queue.py).
_SHARED_NUMEL = 1 << 18


def _build_shared(name: str) -> list[Any]:
    _MODULES[name] = torch.nn.Linear(_SHARED_NUMEL, 1)
    with torch.no_grad():
        for p in _MODULES[name].parameters():
            p.zero_()
    return [rpc.RRef(p) for p in _MODULES[name].parameters()]


def _forward_shared(name: str) -> torch.Tensor:
    """The shared layer on an all-ones input held by the owner (no 1 MB input per RPC)."""
    return _MODULES[name](torch.ones(1, _SHARED_NUMEL)).sum()


def _body_concurrent_trainers(rank: int, impl: str, tag: str) -> tuple[float, float] | None:
    """8 threads x 50 steps on rank 0 and 4 x 25 on rank 2, each process with its own optimizer
    over the same parameters on worker1; SGD(lr=1) with d/dw = d/db = 1 on every step. Returns
    (on rank 0) how many updates the worst element lost and rank 0's trainer seconds."""
    if rank == 0:
        rpc.rpc_sync("worker1", _build_shared, args=(tag,))
    dist.barrier()
    if rank in (0, 2):
        rrefs = rpc.rpc_sync("worker1", _param_rrefs, args=(tag,))
        if impl == "torch":
            from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                opt: Any = TorchDistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
        else:
            opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
        threads, steps = (8, 50) if rank == 0 else (4, 25)
        errors: list[BaseException] = []

        def trainer() -> None:
            try:
                for _ in range(steps):
                    with dist_autograd.context() as cid:
                        out = rpc.rpc_sync("worker1", _forward_shared, args=(tag,))
                        dist_autograd.backward(cid, [out])  # d/dw = 1, d/db = 1
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", DeprecationWarning)
                            opt.step(cid)
            except BaseException as err:
                errors.append(err)

        start = time.perf_counter()
        pool = [threading.Thread(target=trainer) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        _EVENTS.append((f"{tag} trainer", start, time.perf_counter()))
        assert errors == []
    dist.barrier()
    if rank != 0:
        return None
    weight, bias = rpc.rpc_sync("worker1", _snapshot, args=(tag,))
    total = 8 * 50 + 4 * 25
    lost = float(total + torch.cat([weight.flatten(), bias]).min())
    if impl == "shardkit":
        assert torch.equal(weight, torch.full((1, _SHARED_NUMEL), -float(total))), lost
        assert torch.equal(bias, torch.full((1,), -float(total)))
        assert rpc.rpc_sync("worker1", _grads_are_none, args=(tag,))
    return lost, _EVENTS[-1][2] - _EVENTS[-1][1]


def test_concurrent_trainers_lose_no_update(
    rpc_world: Any, record_property: Callable[[str, object], None]
) -> None:
    """Two trainer processes (8 x 50 and 4 x 25 threaded steps) on one 2**18-element parameter:
    shardkit applies all 500 updates to every element. torch's DistributedOptimizer runs the same
    workload first; how many updates it lost is recorded, not asserted (see
    [Note: Where torch's DistributedOptimizer loses updates])."""
    torch_lost = rpc_world.run(_PATH, "_body_concurrent_trainers", "torch", "ct", timeout=120)[0]
    record_property("torch_lost_updates", torch_lost[0])
    shardkit_lost = rpc_world.run(_PATH, "_body_concurrent_trainers", "shardkit", "cs", timeout=120)
    assert shardkit_lost[0][0] == 0.0


def _body_both_entry_points_are_serialised(rank: int, tag: str) -> None:
    """Rank 0 steps through the TorchScript entry point (4 threads x 25, plus state_dict calls),
    rank 2 through the Python one (4 threads x 25, with an lr change now and then), both on one
    2**18-element parameter on worker1 with SGD(lr=1) and d/dw = d/db = 1."""
    if rank == 0:
        rpc.rpc_sync("worker1", _build_shared, args=(tag,))
    dist.barrier()
    if rank in (0, 2):
        rrefs = rpc.rpc_sync("worker1", _param_rrefs, args=(tag,))
        if rank == 2:
            _disable_script_step(True)
        try:
            opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
        finally:
            if rank == 2:
                _disable_script_step(False)
        assert _step_paths(opt) == {"worker1": "script" if rank == 0 else "python"}
        errors: list[BaseException] = []

        def trainer() -> None:
            try:
                for i in range(25):
                    with dist_autograd.context() as cid:
                        out = rpc.rpc_sync("worker1", _forward_shared, args=(tag,))
                        dist_autograd.backward(cid, [out])
                        if rank == 2 and i % 5 == 0:  # the same value: a no-op change, sent
                            opt.param_groups[0]["lr"] = 1 if i % 10 else 1.0
                        opt.step(cid)
                    if rank == 0 and i % 5 == 0:
                        opt.state_dict()
            except BaseException as err:
                errors.append(err)

        pool = [threading.Thread(target=trainer) for _ in range(4)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        assert errors == []
    dist.barrier()
    if rank == 0:
        weight, bias = rpc.rpc_sync("worker1", _snapshot, args=(tag,))
        assert torch.equal(weight, torch.full((1, _SHARED_NUMEL), -200.0)), float(weight.max())
        assert torch.equal(bias, torch.full((1,), -200.0))


def test_both_entry_points_are_serialised(rpc_world: Any) -> None:
    """Steps through the TorchScript and the Python entry points (two trainer processes, plus
    state_dict calls) share the per-parameter queue: all 200 updates land on every element."""
    rpc_world.run(_PATH, "_body_both_entry_points_are_serialised", "both", timeout=120)


class _SlowSGD(torch.optim.SGD):
    """SGD whose step sleeps and records (param-set tag, start, end) on the owner."""

    def __init__(self, params: Any, lr: float, tag: str, delay: float) -> None:
        super().__init__(params, lr=lr)
        self.tag, self.delay = tag, delay

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        start = time.monotonic()
        time.sleep(self.delay)
        super().step()
        _EVENTS.append((self.tag, start, time.monotonic()))


def _overlaps(a: tuple[str, float, float], b: tuple[str, float, float]) -> bool:
    return a[1] < b[2] and b[1] < a[2]


def _body_serialisation_is_scoped_to_the_parameters(rank: int) -> None:
    if rank == 0:
        a = rpc.rpc_sync("worker1", _build, args=("a", 4, 1, 0))
        b = rpc.rpc_sync("worker1", _build, args=("b", 4, 1, 1))
        opt_a1 = DistributedOptimizer(_SlowSGD, a, lr=0.1, tag="a", delay=0.4)
        opt_a2 = DistributedOptimizer(_SlowSGD, a, lr=0.1, tag="a", delay=0.4)
        opt_b = DistributedOptimizer(_SlowSGD, b, lr=0.1, tag="b", delay=0.4)

        def step(opt: DistributedOptimizer, name: str) -> None:
            with dist_autograd.context() as cid:
                out = rpc.rpc_sync("worker1", _forward, args=(name, torch.ones(1, 4)))
                dist_autograd.backward(cid, [out.sum()])
                opt.step(cid)

        pool = [
            threading.Thread(target=step, args=(opt_a1, "a")),
            threading.Thread(target=step, args=(opt_a2, "a")),
            threading.Thread(target=step, args=(opt_b, "b")),
        ]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        events = rpc.rpc_sync("worker1", _events)
        on_a = [e for e in events if e[0] == "a"]
        on_b = [e for e in events if e[0] == "b"]
        assert len(on_a) == 2 and len(on_b) == 1, events
        assert not _overlaps(on_a[0], on_a[1]), f"same parameters stepped concurrently: {events}"
        assert any(_overlaps(e, on_b[0]) for e in on_a), f"disjoint parameters serialised: {events}"
        with pytest.raises(RemoteOptimizerError, match="already split between several"):
            DistributedOptimizer(torch.optim.SGD, [*a, *b], lr=0.1)


def test_serialisation_is_scoped_to_the_parameters(rpc_world: Any) -> None:
    """Optimizers over the same parameters never overlap; over disjoint ones they run in parallel."""

    rpc_world.run(_PATH, "_body_serialisation_is_scoped_to_the_parameters")


# -- checkpointing ------------------------------------------------------------------------------


def _body_state_dict_round_trip_with_renamed_owners(rank: int) -> None:
    if rank == 0:
        batches = list(_batches(6))
        model = _Model(("worker1", "worker2"), "a")
        opt = DistributedOptimizer(torch.optim.Adam, model.groups(), lr=0.01)
        for x, y in batches[:3]:
            _dist_step(model, opt, x, y)
        opt.param_groups[1]["lr"] = 0.02
        saved = opt.state_dict()
        assert sorted(saved["state"]) == [
            "worker0:0",
            "worker1:0",
            "worker1:1",
            "worker2:0",
            "worker2:1",
        ]
        assert saved["param_groups"][0]["params"] == ["worker1:0", "worker1:1"]
        buffer = io.BytesIO()
        torch.save(saved, buffer)  # a plain structure: loadable with weights_only=True
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)

        # A fresh model with the same weights, layers on swapped owners.
        fresh = _Model(("worker2", "worker1"), "b", seed=7)
        now = model.params()
        fresh_opt = DistributedOptimizer(torch.optim.Adam, fresh.groups(), lr=0.5)
        with pytest.raises(ValueError, match="owner_map"):
            fresh_opt.load_state_dict({**loaded, "state": {}}, key_map=lambda k: "worker9:0")
        _copy_weights(fresh, now)
        fresh_opt.load_state_dict(loaded, owner_map={"worker1": "worker2", "worker2": "worker1"})
        assert fresh_opt.param_groups[1]["lr"] == 0.02
        for x, y in batches[3:]:
            _dist_step(model, opt, x, y)
            _dist_step(fresh, fresh_opt, x, y)
        _assert_same(fresh.params(), model.params(), "resumed run")
        again = fresh_opt.state_dict()
        assert sorted(again["state"]) == sorted(saved["state"])


def test_state_dict_round_trip_with_renamed_owners(rpc_world: Any) -> None:
    """Save after 3 steps, load into a fresh optimizer whose layers live on swapped owners
    (owner_map), continue 3 steps: identical to uninterrupted training."""

    rpc_world.run(_PATH, "_body_state_dict_round_trip_with_renamed_owners")


def test_load_state_dict_rejects_mismatches_before_sending(rpc_world: Any) -> None:
    rpc_world.run(_PATH, "_body_load_state_dict_rejects_mismatches_before_sending")


def _set_weights(name: str, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(_MODULES[name].parameters(), values, strict=True):
            p.copy_(v)


def _copy_weights(model: _Model, values: list[torch.Tensor]) -> None:
    rpc.rpc_sync(model.owners[0], _set_weights, args=(f"{model.tag}1", values[0:2]))
    rpc.rpc_sync(model.owners[1], _set_weights, args=(f"{model.tag}2", values[2:4]))
    with torch.no_grad():
        model.scale.copy_(values[4])


def _body_load_state_dict_rejects_mismatches_before_sending(rank: int) -> None:
    if rank == 0:
        rrefs = rpc.rpc_sync("worker1", _build, args=("m", 3, 2, 0))
        opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1, momentum=0.9)
        saved = opt.state_dict()
        with pytest.raises(
            ValueError, match=r"(?s)missing \['worker1:0', 'worker1:1'\].*owner_map"
        ):
            opt.load_state_dict(saved, owner_map={"worker1": "other"})
        with pytest.raises(ValueError, match="has 2 param group"):
            opt.load_state_dict({**saved, "param_groups": saved["param_groups"] * 2})
        with pytest.raises(TypeError, match="int ids"):
            local = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
            opt.load_state_dict(local.state_dict())
        opt.load_state_dict(saved, key_map={"worker1:0": "worker1:0"})


# -- schedulers ---------------------------------------------------------------------------------


def _body_lr_scheduler_parity(rank: int) -> None:
    if rank == 0:
        makers: list[Callable[[torch.optim.Optimizer], Any]] = [
            lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
            lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.8**e),
        ]
        for i, make in enumerate(makers):
            model, ref = _Model(("worker1", "worker2"), f"s{i}"), _Reference()
            opt = DistributedOptimizer(torch.optim.SGD, model.groups(), lr=0.1, momentum=0.9)
            ref_opt = torch.optim.SGD(ref.groups(), lr=0.1, momentum=0.9)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sched, ref_sched = make(opt.scheduler_view), make(ref_opt)
                for x, y in _batches(5):
                    _dist_step(model, opt, x, y)
                    _local_step(ref, ref_opt, x, y)
                    sched.step()
                    ref_sched.step()
                    assert sched.get_last_lr() == ref_sched.get_last_lr()
            assert [str(w.message) for w in caught] == []
            _assert_same(model.params(), ref.params(), f"scheduler {i}")
            assert opt.state_dict()["param_groups"][0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_lr_scheduler_parity(rpc_world: Any) -> None:
    """StepLR and LambdaLR on scheduler_view match the same schedulers on a local optimizer."""

    rpc_world.run(_PATH, "_body_lr_scheduler_parity")


# -- failures -----------------------------------------------------------------------------------


class _FailingSGD(torch.optim.SGD):
    """SGD that raises on the owners listed in ``fail_on``."""

    def __init__(self, params: Any, lr: float, fail_on: tuple[str, ...]) -> None:
        super().__init__(params, lr=lr)
        self.fail_on = fail_on

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        me = rpc.get_worker_info().name
        if me in self.fail_on:
            raise RuntimeError(f"injected failure on {me}")
        super().step()


def _body_failures_name_every_owner(rank: int) -> None:
    if rank == 0:
        model = _Model(("worker1", "worker2"), "f")
        x, y = next(_batches(1))

        def step_with(opt: DistributedOptimizer, **kwargs: Any) -> None:
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [model.loss(x, y)])
                opt.step(cid, **kwargs)

        both = DistributedOptimizer(
            _FailingSGD, model.groups(), lr=0.1, fail_on=("worker1", "worker2")
        )
        with pytest.raises(RemoteOptimizerError) as info:
            step_with(both)
        assert set(info.value.failures) == {"worker1", "worker2"}
        assert info.value.succeeded == ["worker0"]
        assert "injected failure on worker1" in str(info.value)
        assert "injected failure on worker2" in str(info.value)
        # ... from the TorchScript entry point, with the owner's error type and traceback.
        assert _step_paths(both)["worker1"] == "script"
        failure = str(info.value.failures["worker1"])
        assert failure.startswith("RuntimeError: injected failure on worker1"), failure
        assert "Owner traceback" in failure and "in step" in failure, failure

        one = DistributedOptimizer(_FailingSGD, model.l1, lr=0.1, fail_on=("worker2",))
        step_with(one)  # worker2 holds none of these parameters

        slow = DistributedOptimizer(_SlowSGD, model.l2, lr=0.1, tag="slow", delay=3.0)
        start = time.monotonic()
        with pytest.raises(RemoteOptimizerError, match=r"\[worker2\]") as timed:
            step_with(slow, timeout=0.5)
        assert time.monotonic() - start < 2.5
        assert list(timed.value.failures) == ["worker2"]
        assert "timeout" in str(timed.value.failures["worker2"]).lower()
        time.sleep(3.0)  # let the slow remote step finish
        step_with(slow, timeout=10.0)
        slow_steps = [e for e in rpc.rpc_sync("worker2", _events) if e[0] == "slow"]
        assert len(slow_steps) == 2, slow_steps  # the timed-out step was applied late

        with pytest.raises(
            RemoteOptimizerError, match=r"(?s)worker1.*worker2.*Invalid learning rate"
        ):
            DistributedOptimizer(torch.optim.SGD, [*model.l1, *model.l2], lr=-1.0)
        with pytest.raises(RemoteOptimizerError, match=r"holds a list, expected a torch.Tensor"):
            DistributedOptimizer(torch.optim.SGD, [rpc.remote("worker1", _not_a_tensor)], lr=0.1)

        before = model.params()
        sgd = DistributedOptimizer(torch.optim.SGD, model.groups(), lr=0.1)
        with pytest.raises(TypeError, match="context_id must be an int"):
            sgd.step("3")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="not a live distributed autograd context"):
            sgd.step(987654321)
        with dist_autograd.context() as cid:
            pass
        with pytest.raises(ValueError, match="not a live"):
            sgd.step(cid)  # the context has exited
        with pytest.raises(ValueError, match="timeout must be"):
            sgd.step(cid, timeout=0)
        _assert_same(model.params(), before, "after rejected steps")


def test_failures_name_every_owner(rpc_world: Any) -> None:
    """Every failing owner is named; a per-call timeout raises in time; bad context ids and
    timeouts are rejected before any RPC."""
    rpc_world.run(_PATH, "_body_failures_name_every_owner")


def test_unknown_context_on_owner_means_no_gradients(rpc_world: Any) -> None:
    """An owner that took no part in the context skips its parameters (pins the torch error
    message recognised by _torch_compat)."""
    rpc_world.run(_PATH, "_body_unknown_context_on_owner_means_no_gradients")


def _body_unknown_context_on_owner_means_no_gradients(rank: int) -> None:
    if rank == 0:
        with pytest.raises(RuntimeError) as info:
            dist_autograd.get_gradients(123456789)
        assert is_unknown_context_error(info.value)
        remote = rpc.rpc_sync("worker1", _build, args=("u", 2, 1, 0))
        local = torch.nn.Parameter(torch.ones(2))
        opt = DistributedOptimizer(torch.optim.SGD, [*remote, rpc.RRef(local)], lr=1.0)
        before = rpc.rpc_sync("worker1", _snapshot, args=("u",))
        rpc.rpc_sync("worker1", _capture_logs, args=(True,))
        try:
            for _ in range(2):
                with dist_autograd.context() as cid:
                    dist_autograd.backward(cid, [(local * 3).sum()])
                    opt.step(cid)
        finally:
            logged = rpc.rpc_sync("worker1", _capture_logs, args=(False,))
        assert torch.equal(local.detach(), torch.full((2,), -5.0))
        _assert_same(rpc.rpc_sync("worker1", _snapshot, args=("u",)), before, "untouched owner")
        # Skipping is logged once (debug level) on the owner.
        assert len(logged) == 1, logged
        assert logged[0][0] == logging.DEBUG and "no gradient on worker1" in logged[0][1], logged


# -- lifetime -----------------------------------------------------------------------------------


def _handle_alive(handle: int) -> bool:
    from shardkit.rpc._local_optimizer import _handles

    ref = _handles.get(handle)
    return ref is not None and ref() is not None


def _body_owner_optimizer_is_freed_with_the_trainers(rank: int) -> None:
    if rank != 0:
        return
    import gc

    from shardkit.rpc._script_step import script_step

    rrefs = rpc.rpc_sync("worker1", _build, args=("life", 3, 2, 0))
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1)
    handle = opt._remote["worker1"]
    assert rpc.rpc_sync("worker1", _handle_alive, args=(handle,))
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync("worker1", _forward, args=("life", torch.ones(1, 3)))
        dist_autograd.backward(cid, [out.sum()])
        opt.step(cid)
    del opt
    gc.collect()
    deadline = time.monotonic() + 30
    while rpc.rpc_sync("worker1", _handle_alive, args=(handle,)):
        assert time.monotonic() < deadline, "owner kept the optimizer after the trainer dropped it"
        time.sleep(0.05)
    with dist_autograd.context() as cid:
        try:
            outcome: object = rpc.rpc_sync("worker1", _remote_step, args=(handle, cid))
        except RuntimeError as err:
            outcome = err
        assert isinstance(outcome, RuntimeError) and "was freed" in str(outcome), outcome
        # The TorchScript entry point reports it as text (the trainer raises it).
        text = rpc.rpc_sync("worker1", script_step, args=(handle, cid))
        assert isinstance(text, str) and text.startswith("RuntimeError: no Distributed"), text
        assert "was freed" in text, text


def test_owner_optimizer_is_freed_with_the_trainers(rpc_world: Any) -> None:
    """Steps name the owner's optimizer by handle (see [Note: Optimizer handles]) but its lifetime
    follows the trainer's RRef: dropping the DistributedOptimizer (after a step) frees it on the
    owner, and a stale handle raises a clear error through both step entry points."""
    rpc_world.run(_PATH, "_body_owner_optimizer_is_freed_with_the_trainers")


# -- observability ------------------------------------------------------------------------------


def _trace_names(path: Path) -> set[str]:
    with open(path) as f:
        return {event.get("name", "") for event in json.load(f)["traceEvents"]}


def _body_profiler_trace_shows_step_phases(rank: int, trace_dir: str) -> None:
    """See [Note: RPC profiler ranges]: the trainer's trace shows the step, one request per owner and
    the wait; an owner's (all threads) shows the step it applied."""
    owner_config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    if rank == 0:
        model = _Model(("worker1", "worker2"), "prof")
        opt = DistributedOptimizer(torch.optim.SGD, model.groups(), lr=0.1)
        x, y = next(_batches(1))
        _dist_step(model, opt, x, y)  # warm, unprofiled
    dist.barrier()
    if rank == 0:
        with warnings.catch_warnings():
            # "Profiling a distributed call with the Kineto profiler will profile the caller,
            # but not the worker": the owners run their own profiler below.
            warnings.simplefilter("ignore")
            with torch.profiler.profile(activities=cpu) as prof:
                _dist_step(model, opt, x, y)
        prof.export_chrome_trace(os.path.join(trace_dir, "trainer.json"))
        names = _trace_names(Path(trace_dir, "trainer.json"))
        wanted = {
            "shardkit.rpc.step",
            "shardkit.rpc.step.request[worker1]",
            "shardkit.rpc.step.request[worker2]",
            "shardkit.rpc.step.request[worker0]",
            "shardkit.rpc.step.wait",
        }
        assert wanted <= names, sorted(n for n in names if "shardkit" in n)
        dist.barrier()  # the owner's profiler is running
        _dist_step(model, opt, x, y)
        dist.barrier()
    elif rank == 1:
        with torch.profiler.profile(activities=cpu, experimental_config=owner_config) as owner_prof:
            dist.barrier()  # the trainer steps
            dist.barrier()
        owner_prof.export_chrome_trace(os.path.join(trace_dir, "owner.json"))
        names = _trace_names(Path(trace_dir, "owner.json"))
        assert "shardkit.rpc.owner.step" in names, sorted(n for n in names if "shard" in n)
    else:
        dist.barrier()
        dist.barrier()


def test_profiler_trace_shows_step_phases(rpc_world: Any, tmp_path: Path) -> None:
    rpc_world.run(_PATH, "_body_profiler_trace_shows_step_phases", str(tmp_path))
