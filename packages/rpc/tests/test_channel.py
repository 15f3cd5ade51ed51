"""Tier 2: the direct step channel (see [Note: Direct step channel] in _channel.py), 3 ranks.

worker0 trains, worker1 and worker2 own parameters; one RPC session for the module (the
``rpc_world`` fixture). Bodies use distinct tags for what they build.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from shardkit.rpc import DistributedOptimizer, RemoteOptimizerError
from shardkit.rpc._channel import ENV_VAR, ERROR, HELLO, OK, STEP, pack_request, read_reply
from shardkit.rpc._torch_compat import context_gradients

_PATH = os.path.abspath(__file__)
_MODULES: dict[str, torch.nn.Module] = {}
_OWNERS = ("worker1", "worker2")


# -- owner-side helpers (called over RPC) ---------------------------------------------------------


def _build(name: str, fan_in: int, fan_out: int, seed: int) -> list[Any]:
    torch.manual_seed(seed)
    _MODULES[name] = torch.nn.Linear(fan_in, fan_out)
    return [rpc.RRef(p) for p in _MODULES[name].parameters()]


def _forward(name: str, x: torch.Tensor) -> torch.Tensor:
    return _MODULES[name](x)


def _snapshot(name: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in _MODULES[name].parameters()]


def _owner_local(handle: int) -> Any:
    from shardkit.rpc._owner import _lookup

    return _lookup(handle)


def _owner_direct_steps(handle: int) -> int:
    return int(_owner_local(handle).direct_steps)


def _owner_group_option(handle: int, group: int, key: str) -> Any:
    return _owner_local(handle).optimizer.param_groups[group][key]


def _set_env(value: str | None) -> None:
    if value is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = value


# -- trainer-side helpers ---------------------------------------------------------------------------


class _Model:
    """Layer 1 on worker1, layer 2 on worker2."""

    def __init__(self, tag: str, seed: int = 0) -> None:
        self.tag = tag
        self.l1 = rpc.rpc_sync("worker1", _build, args=(f"{tag}1", 6, 5, seed))
        self.l2 = rpc.rpc_sync("worker2", _build, args=(f"{tag}2", 5, 3, seed + 1))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = rpc.rpc_sync("worker1", _forward, args=(f"{self.tag}1", x)).tanh()
        return ((rpc.rpc_sync("worker2", _forward, args=(f"{self.tag}2", h)) - y) ** 2).mean()

    def params(self) -> list[torch.Tensor]:
        return [
            *rpc.rpc_sync("worker1", _snapshot, args=(f"{self.tag}1",)),
            *rpc.rpc_sync("worker2", _snapshot, args=(f"{self.tag}2",)),
        ]


class _Reference(torch.nn.Module):
    """The same model in one process."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(6, 5)
        torch.manual_seed(seed + 1)
        self.l2 = torch.nn.Linear(5, 3)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.l2(self.l1(x).tanh()) - y) ** 2).mean()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.parameters()]


def _batches(n: int, seed: int = 100) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _dist_step(model: _Model, opt: DistributedOptimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [model.loss(x, y)])
        opt.step(cid)


def _local_step(
    ref: _Reference, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    opt.zero_grad()
    ref.loss(x, y).backward()
    opt.step()


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"{what}: tensor {i} differs by {(g - w).abs().max().item()}"


def _sent(opt: DistributedOptimizer) -> dict[str, int]:
    assert opt._direct is not None, "the direct step channel is off"
    return dict(opt._direct.sent)


def _direct_steps(opt: DistributedOptimizer, owner: str) -> int:
    return int(rpc.rpc_sync(owner, _owner_direct_steps, args=(opt._remote[owner],)))


def _sgd(model: _Model) -> DistributedOptimizer:
    return DistributedOptimizer(torch.optim.SGD, [*model.l1, *model.l2], lr=0.1, momentum=0.9)


def _train_pair(model: _Model, opt: DistributedOptimizer, steps: int = 3) -> None:
    """``steps`` steps of ``model`` and of a local reference; asserts they end bit-for-bit equal."""
    ref = _Reference()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _assert_same(model.params(), ref.params(), "initial parameters")
    for x, y in _batches(steps):
        _dist_step(model, opt, x, y)
        _local_step(ref, ref_opt, x, y)
    _assert_same(model.params(), ref.params(), f"after {steps} steps")


# -- opt-out and fallback ---------------------------------------------------------------------------


def _body_env_var_off_uses_rpc(rank: int) -> None:
    if rank != 0:
        return
    # Off on the trainer: no channel at all, every step over RPC, same results.
    _set_env("0")
    try:
        model = _Model("envt")
        opt = _sgd(model)
    finally:
        _set_env(None)
    assert opt._direct is None
    _train_pair(model, opt)
    assert _direct_steps(opt, "worker1") == _direct_steps(opt, "worker2") == 0

    # Off on one owner (read when it builds its optimizer): that owner over RPC, the other direct.
    rpc.rpc_sync("worker1", _set_env, args=("0",))
    try:
        model = _Model("envo")
        opt = _sgd(model)
    finally:
        rpc.rpc_sync("worker1", _set_env, args=(None,))
    _train_pair(model, opt)
    assert _sent(opt) == {"worker2": 3}
    assert _direct_steps(opt, "worker1") == 0
    assert _direct_steps(opt, "worker2") == 3


def test_env_var_off_uses_rpc(rpc_world: Any) -> None:
    """SHARDKIT_RPC_DIRECT_STEP=0 on the trainer or on one owner: RPC there, identical results."""
    rpc_world.run(_PATH, "_body_env_var_off_uses_rpc")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _body_unreachable_owner_warns_once_and_uses_rpc(rank: int) -> None:
    if rank != 0:
        return
    model = _Model("unr")
    opt = _sgd(model)
    assert opt._direct is not None
    (host, _, _), handle, token = opt._direct._routes["worker1"]
    opt._direct._routes["worker1"] = ((host, ["127.0.0.1"], _closed_port()), handle, token)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_pair(model, opt)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "'worker1'" in messages[0] and ENV_VAR in messages[0], messages[0]
    assert _sent(opt) == {"worker1": 0, "worker2": 3}
    assert _direct_steps(opt, "worker1") == 0


def test_unreachable_owner_warns_once_and_uses_rpc(rpc_world: Any) -> None:
    """An owner whose step server cannot be reached: one warning naming it and the env var,
    then RPC for that owner; results still bit-for-bit those of a local optimizer."""
    rpc_world.run(_PATH, "_body_unreachable_owner_warns_once_and_uses_rpc")


# -- security -------------------------------------------------------------------------------------


def _body_wrong_token_and_unknown_handle_are_refused(rank: int) -> None:
    if rank != 0:
        return
    model = _Model("tok")
    opt = _sgd(model)
    assert opt._direct is not None
    (_, _, port), handle, token = opt._direct._routes["worker1"]
    wrong = bytes(b ^ 0xFF for b in token)
    before = model.params()
    x, y = next(_batches(1))
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [model.loss(x, y)])  # gradients a step would apply
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(pack_request(STEP, handle, wrong, cid))
            status, message = read_reply(sock)
            assert status == ERROR and "wrong token" in message, message
            assert sock.recv(1) == b"", "the connection must be closed after a wrong token"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(pack_request(STEP, 10**12, token, cid, b'{"0":{"lr":5.0}}'))
            status, message = read_reply(sock)
            assert status == ERROR and "no DistributedOptimizer with handle" in message, message
            sock.sendall(pack_request(HELLO, handle, token, 0))  # still open, still in sync
            assert read_reply(sock) == (OK, "")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            header_size = len(pack_request(HELLO, 0, bytes(16), 0))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(header_size, b"x"))
            status, message = read_reply(sock)
            assert status == ERROR and "not a shardkit-rpc step request" in message, message
            assert sock.recv(1) == b""
    _assert_same(model.params(), before, "after refused requests")
    assert _direct_steps(opt, "worker1") == 0
    assert rpc.rpc_sync("worker1", _owner_group_option, args=(handle, 0, "lr")) == 0.1


def test_wrong_token_and_unknown_handle_are_refused(rpc_world: Any) -> None:
    """Raw requests with a wrong token (error reply, connection closed), an unknown handle (error
    reply, connection kept) or garbage (error reply, closed) apply nothing."""
    rpc_world.run(_PATH, "_body_wrong_token_and_unknown_handle_are_refused")


# -- hyper-parameters -----------------------------------------------------------------------------


def _body_updates_through_the_channel(rank: int) -> None:
    if rank != 0:
        return
    # Adam's betas are a tuple: they must arrive as one (Adam indexes and unpacks them).
    model = _Model("upa")
    opt = DistributedOptimizer(torch.optim.Adam, [*model.l1, *model.l2], lr=0.01)
    ref = _Reference()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    batches = list(_batches(4))
    for i, (x, y) in enumerate(batches):
        if i == 2:
            for group in (opt.param_groups[0], ref_opt.param_groups[0]):
                group["betas"] = (0.8, 0.95)
                group["eps"] = 1e-6
        _dist_step(model, opt, x, y)
        _local_step(ref, ref_opt, x, y)
    assert _sent(opt) == {"worker1": 4, "worker2": 4}
    for owner in _OWNERS:
        betas = rpc.rpc_sync(owner, _owner_group_option, args=(opt._remote[owner], 0, "betas"))
        assert type(betas) is tuple and betas == (0.8, 0.95), betas
    _assert_same(model.params(), ref.params(), "Adam with a betas update")

    # A tensor lr is not JSON: that step goes over RPC for every owner, and is applied.
    model = _Model("upt")
    opt = _sgd(model)
    ref = _Reference()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        if i == 1:
            for group in (opt.param_groups[0], ref_opt.param_groups[0]):
                group["lr"] = torch.tensor(0.05)
        _dist_step(model, opt, x, y)
        _local_step(ref, ref_opt, x, y)
        assert _sent(opt) == dict.fromkeys(_OWNERS, i if i >= 1 else 1), (i, _sent(opt))
    for owner in _OWNERS:
        lr = rpc.rpc_sync(owner, _owner_group_option, args=(opt._remote[owner], 0, "lr"))
        assert isinstance(lr, torch.Tensor) and torch.equal(lr, torch.tensor(0.05)), lr
    _assert_same(model.params(), ref.params(), "SGD with a tensor lr")


def test_updates_through_the_channel(rpc_world: Any) -> None:
    """A betas update arrives as a tuple (JSON path); a tensor lr update sends that one step over
    RPC, is applied, and later steps use the channel again."""
    rpc_world.run(_PATH, "_body_updates_through_the_channel")


# -- exactness across both paths ------------------------------------------------------------------

_SHARED_NUMEL = 1 << 18


def _build_shared(name: str) -> list[Any]:
    _MODULES[name] = torch.nn.Linear(_SHARED_NUMEL, 1)
    with torch.no_grad():
        for p in _MODULES[name].parameters():
            p.zero_()
    return [rpc.RRef(p) for p in _MODULES[name].parameters()]


def _forward_shared(name: str) -> torch.Tensor:
    return _MODULES[name](torch.ones(1, _SHARED_NUMEL)).sum()


def _param_rrefs(name: str) -> list[Any]:
    return [rpc.RRef(p) for p in _MODULES[name].parameters()]


def _body_channel_and_rpc_steps_are_serialised(rank: int, tag: str) -> int | None:
    """Rank 0 steps over the channel (4 threads x 25, plus state_dict calls over RPC), rank 2 over
    RPC (channel off there, 4 threads x 25), both on one 2**18-element parameter on worker1."""
    if rank == 0:
        rpc.rpc_sync("worker1", _build_shared, args=(tag,))
    dist.barrier()
    if rank in (0, 2):
        rrefs = rpc.rpc_sync("worker1", _param_rrefs, args=(tag,))
        if rank == 2:
            _set_env("0")
        try:
            opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=1.0)
        finally:
            _set_env(None)
        assert (opt._direct is None) == (rank == 2)
        errors: list[BaseException] = []

        def trainer() -> None:
            try:
                for i in range(25):
                    with dist_autograd.context() as cid:
                        out = rpc.rpc_sync("worker1", _forward_shared, args=(tag,))
                        dist_autograd.backward(cid, [out])  # d/dw = d/db = 1
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
        if rank == 0:
            assert _sent(opt) == {"worker1": 100}
    dist.barrier()
    if rank != 0:
        return None
    weight, bias = rpc.rpc_sync("worker1", _snapshot, args=(tag,))
    assert torch.equal(weight, torch.full((1, _SHARED_NUMEL), -200.0)), float(weight.max())
    assert torch.equal(bias, torch.full((1,), -200.0))
    return 0


def test_channel_and_rpc_steps_are_serialised(rpc_world: Any) -> None:
    """Steps over the channel and over RPC (another trainer process, plus state_dict calls) go
    through the same per-parameter queue: all 200 updates land on every element."""
    rpc_world.run(_PATH, "_body_channel_and_rpc_steps_are_serialised", "ser", timeout=120)


# -- torch behaviour the channel relies on --------------------------------------------------------


def _grads_from_plain_thread(name: str, context_id: int) -> list[torch.Tensor]:
    """This worker's gradients in ``context_id``, read from a thread that is not an RPC thread."""
    found: list[Any] = []

    def read() -> None:
        try:
            grads = context_gradients(context_id, missing_ok=False)
            assert grads is not None
            found.extend(grads[p].clone() for p in _MODULES[name].parameters())
        except BaseException as err:
            found.append(err)

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    if found and isinstance(found[0], BaseException):
        raise found[0]
    return found


def _body_get_gradients_from_a_non_rpc_thread(rank: int) -> None:
    if rank != 0:
        return
    rpc.rpc_sync("worker1", _build, args=("gth", 4, 2, 0))
    x = torch.arange(8.0).reshape(2, 4)
    with dist_autograd.context() as cid:
        out = rpc.rpc_sync("worker1", _forward, args=("gth", x))
        dist_autograd.backward(cid, [out.sum()])
        grads = rpc.rpc_sync("worker1", _grads_from_plain_thread, args=("gth", cid))
    assert len(grads) == 2
    assert torch.equal(grads[0], x.sum(0).expand(2, 4))  # d(sum(xW^T + b))/dW
    assert torch.equal(grads[1], torch.full((2,), 2.0))  # d/db: 2 rows


def test_get_gradients_from_a_non_rpc_thread(rpc_world: Any) -> None:
    """Pins what the channel's handler threads rely on: `dist_autograd.get_gradients` works from
    a plain thread (the context container is process-global, not tied to RPC threads)."""
    rpc_world.run(_PATH, "_body_get_gradients_from_a_non_rpc_thread")


# -- failures --------------------------------------------------------------------------------------


class _BrokenSGD(torch.optim.SGD):
    """SGD whose step raises on worker2."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if rpc.get_worker_info().name == "worker2":
            raise ValueError("bad step on worker2")
        super().step()


def _body_failing_owner_through_the_channel(rank: int) -> None:
    if rank != 0:
        return
    model = _Model("brk")
    opt = DistributedOptimizer(_BrokenSGD, [*model.l1, *model.l2], lr=0.1)
    x, y = next(_batches(1))
    with pytest.raises(RemoteOptimizerError) as info:
        _dist_step(model, opt, x, y)
    assert list(info.value.failures) == ["worker2"] and info.value.succeeded == ["worker1"]
    failure = str(info.value.failures["worker2"])
    assert failure.startswith("ValueError: bad step on worker2"), failure
    assert "Owner traceback" in failure and "in step" in failure, failure
    assert _sent(opt) == {"worker1": 1, "worker2": 1}
    with pytest.raises(RemoteOptimizerError, match=r"\[worker2\]"):  # connection still usable
        _dist_step(model, opt, x, y)
    assert _sent(opt) == {"worker1": 2, "worker2": 2}
    assert _direct_steps(opt, "worker1") == 2


def test_failing_owner_through_the_channel(rpc_world: Any) -> None:
    """An owner whose step raises is named, with its error type, message and traceback; the
    other owner's step succeeds; the connection stays usable."""
    rpc_world.run(_PATH, "_body_failing_owner_through_the_channel")
