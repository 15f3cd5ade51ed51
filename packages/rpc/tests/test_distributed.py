"""Tier 2: multi-process RPC tests (TensorPipe over localhost) through shardkit.testing.

Rank 0 is the trainer; other ranks own parameters. Each test launches fresh rank processes
(see [Note: One RPC session per process]).
"""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from shardkit.rpc import DistributedOptimizer, RemoteOptimizerError
from shardkit.rpc._torch_compat import is_unknown_context_error
from shardkit.testing import free_port

# Rank processes import this file under a per-process module name; RPC pickles functions and
# classes by reference, so give them one stable name that resolves in every rank.
_ALIAS = "shardkit_rpc_test_distributed"
sys.modules.setdefault(_ALIAS, sys.modules[__name__])

# Per-process registry of owner-side modules / parameters built by the tests.
_MODULES: dict[str, torch.nn.Module] = {}
_EVENTS: list[tuple[str, float, float]] = []


def _stable(obj: Any) -> Any:
    obj.__module__ = _ALIAS
    return obj


def _name(rank: int) -> str:
    return f"worker{rank}"


def _start_rpc(port: int, timeout: float = 30.0) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=timeout, num_worker_threads=16
    )
    rpc.init_rpc(_name(rank), rank=rank, world_size=size, rpc_backend_options=options)


def _stop_rpc() -> None:
    # Every RRef must be dead before shutdown: a UserRRef collected after it would try to message
    # its owner on a stopped agent, and a later init_rpc in this reused process could hang.
    gc.collect()
    rpc.shutdown()
    _MODULES.clear()
    _EVENTS.clear()


# [Note: One RPC session per process]
# torch.distributed.rpc cannot be initialised again in a process where it was shut down (on
# torch 2.13 the second session's RRef messages fail with "RPC is no longer running on this
# node" and its shutdown times out on the store), so these tests cannot use the reused
# @world processes: each test launches fresh rank processes with this file's `_child_main`,
# under a hard timeout that kills every rank and reports their output.
_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location({alias!r}, {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules[{alias!r}] = module
spec.loader.exec_module(module)
module._child_main(sys.argv[1:])
"""


def _child_main(argv: list[str]) -> None:
    body_name, rank, size, rpc_port, pg_port, *extra = argv
    r, n = int(rank), int(size)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=r, world_size=n)
    try:
        _start_rpc(int(rpc_port))
        try:
            # No barrier after the body: a rank whose body raised would leave the others
            # blocked in it. rpc.shutdown() (graceful) is the rendezvous instead.
            for name in body_name.split("+"):
                globals()[name](r, *extra)
        finally:
            _stop_rpc()
    finally:
        dist.destroy_process_group()


def _launch(world_size: int, body_name: str, *extra: str, timeout: float = 120.0) -> None:
    """Run ``body_name(rank, *extra)`` on ``world_size`` fresh processes with RPC started."""
    code = _CHILD.format(alias=_ALIAS, path=os.path.abspath(__file__))
    ports = [str(free_port()), str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, body_name, str(r), str(world_size), *ports, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    timed_out = False
    try:
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                for other in procs:
                    other.kill()
                out, _ = proc.communicate()
            outputs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    if timed_out or any(codes):
        report = "\n".join(
            f"----- rank {r} (exit {c}) -----\n{o[-6000:]}"
            for r, (c, o) in enumerate(zip(codes, outputs, strict=True))
        )
        pytest.fail(
            f"{body_name} {'timed out' if timed_out else 'failed'}:\n{report}", pytrace=False
        )


@_stable
def _build(name: str, fan_in: int, fan_out: int, seed: int) -> list[Any]:
    torch.manual_seed(seed)
    _MODULES[name] = torch.nn.Linear(fan_in, fan_out)
    return [rpc.RRef(p) for p in _MODULES[name].parameters()]


@_stable
def _forward(name: str, x: torch.Tensor) -> torch.Tensor:
    return _MODULES[name](x)


@_stable
def _snapshot(name: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in _MODULES[name].parameters()]


@_stable
def _grads_are_none(name: str) -> bool:
    return all(p.grad is None for p in _MODULES[name].parameters())


@_stable
def _param_rrefs(name: str) -> list[Any]:
    return [rpc.RRef(p) for p in _MODULES[name].parameters()]


@_stable
def _not_a_tensor() -> list[int]:
    return [1, 2, 3]


@_stable
def _events() -> list[tuple[str, float, float]]:
    return list(_EVENTS)


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


def _body_parity_with_single_process(rank: int, opt_names: str) -> None:
    if rank != 0:
        return
    for opt_name in opt_names.split(","):
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
        assert opt.param_groups[0]["lr"] == 0.05
        assert opt.param_groups[1]["lr"] == kwargs["lr"]
        assert rpc.rpc_sync("worker1", _grads_are_none, args=(f"m{opt_name}1",))
        assert rpc.rpc_sync("worker2", _grads_are_none, args=(f"m{opt_name}2",))
        assert model.scale.grad is None


def test_parity_with_single_process() -> None:
    """Bit-for-bit equal to the same model and optimizer in one process (param groups,
    a trainer-owned parameter, two remote owners), with no warnings and no stale .grad.
    One launch runs every optimizer in turn (process start-up dominates the cost)."""
    _launch(3, "_body_parity_with_single_process", ",".join(_OPTIMIZERS))


# -- concurrency --------------------------------------------------------------------------------


def _body_concurrent_trainers_lose_no_update(rank: int) -> None:
    if rank == 1:
        torch.manual_seed(0)
        _MODULES["shared"] = torch.nn.Linear(16, 1)
        with torch.no_grad():
            for p in _MODULES["shared"].parameters():
                p.zero_()
    dist.barrier()
    if rank in (0, 2):
        rrefs = rpc.rpc_sync("worker1", _param_rrefs, args=("shared",))
        opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
        threads, steps = (8, 50) if rank == 0 else (4, 25)
        errors: list[BaseException] = []

        def trainer() -> None:
            try:
                x = torch.ones(1, 16)
                for _ in range(steps):
                    with dist_autograd.context() as cid:
                        out = rpc.rpc_sync("worker1", _forward, args=("shared", x))
                        dist_autograd.backward(cid, [out.sum()])  # d/dw = 1, d/db = 1
                        opt.step(cid)
            except BaseException as err:
                errors.append(err)

        pool = [threading.Thread(target=trainer) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        assert errors == []
    dist.barrier()
    if rank == 0:
        weight, bias = rpc.rpc_sync("worker1", _snapshot, args=("shared",))
        total = 8 * 50 + 4 * 25
        assert torch.equal(weight, torch.full((1, 16), -float(total)))
        assert torch.equal(bias, torch.full((1,), -float(total)))
        assert rpc.rpc_sync("worker1", _grads_are_none, args=("shared",))


def test_concurrent_trainers_lose_no_update() -> None:
    """8 threads x 50 steps on rank 0 plus 4 threads x 25 steps on rank 2 (each process with its
    own DistributedOptimizer over the same parameters on worker1): every step is applied."""

    _launch(3, "_body_concurrent_trainers_lose_no_update")


@_stable
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


def test_serialisation_is_scoped_to_the_parameters() -> None:
    """Optimizers over the same parameters never overlap; over disjoint ones they run in parallel."""

    _launch(2, "_body_serialisation_is_scoped_to_the_parameters")


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


def test_state_dict_round_trip_with_renamed_owners() -> None:
    """Save after 3 steps, load into a fresh optimizer whose layers live on swapped owners
    (owner_map), continue 3 steps: identical to uninterrupted training."""

    _launch(
        3,
        "_body_state_dict_round_trip_with_renamed_owners"
        "+_body_load_state_dict_rejects_mismatches_before_sending",
    )


@_stable
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


def test_lr_scheduler_parity() -> None:
    """StepLR and LambdaLR on scheduler_view match the same schedulers on a local optimizer."""

    _launch(3, "_body_lr_scheduler_parity")


# -- failures -----------------------------------------------------------------------------------


@_stable
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

        one = DistributedOptimizer(_FailingSGD, model.l1, lr=0.1, fail_on=("worker2",))
        step_with(one)  # worker2 holds none of these parameters

        slow = DistributedOptimizer(_SlowSGD, model.l2, lr=0.1, tag="slow", delay=3.0)
        start = time.monotonic()
        with pytest.raises(RemoteOptimizerError, match=r"\[worker2\]") as timed:
            step_with(slow, timeout=0.5)
        assert time.monotonic() - start < 2.5
        assert list(timed.value.failures) == ["worker2"]
        time.sleep(3.0)  # let the slow remote step finish before shutdown

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


def test_failures_name_every_owner() -> None:
    _launch(3, "_body_failures_name_every_owner+_body_unknown_context_on_owner_means_no_gradients")


def _body_unknown_context_on_owner_means_no_gradients(rank: int) -> None:
    if rank == 0:
        with pytest.raises(RuntimeError) as info:
            dist_autograd.get_gradients(123456789)
        assert is_unknown_context_error(info.value)
        remote = rpc.rpc_sync("worker1", _build, args=("u", 2, 1, 0))
        local = torch.nn.Parameter(torch.ones(2))
        opt = DistributedOptimizer(torch.optim.SGD, [*remote, rpc.RRef(local)], lr=1.0)
        before = rpc.rpc_sync("worker1", _snapshot, args=("u",))
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [(local * 3).sum()])
            opt.step(cid)
        assert torch.equal(local.detach(), torch.full((2,), -2.0))
        _assert_same(rpc.rpc_sync("worker1", _snapshot, args=("u",)), before, "untouched owner")
