"""Tier 1: the direct step channel in one process, without RPC (a fake owner-side optimizer).

See [Note: Direct step channel] in _channel.py; the 3-rank tests are in test_channel.py.
"""

from __future__ import annotations

import math
import secrets
import socket
import struct
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from shardkit.rpc import _channel
from shardkit.rpc._channel import (
    ENV_VAR,
    ERROR,
    HELLO,
    OK,
    STEP,
    DirectSteps,
    decode_updates,
    enabled,
    encode_updates,
    pack_request,
    read_reply,
    wait_limit,
)

# -- payload --------------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple),
    max_leaves=8,
)


def _identical(a: Any, b: Any) -> bool:
    """Same types all the way down and same values (nan equal to nan, -0.0 distinct from 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    return bool(a == b)


@given(
    st.dictionaries(
        st.integers(min_value=0, max_value=50),
        st.dictionaries(st.text(max_size=6), _values, max_size=4),
        max_size=3,
    )
)
def test_updates_round_trip_exactly(updates: dict[int, dict[str, Any]]) -> None:
    payload = encode_updates(updates)
    assert payload is not None
    decoded = decode_updates(payload) if updates else {}
    assert decoded is not None and decoded.keys() == updates.keys()
    for g, changes in updates.items():
        assert decoded[g].keys() == changes.keys()
        for k, v in changes.items():
            assert _identical(decoded[g][k], v), (k, v, decoded[g][k])


class _MyFloat(float):
    pass


@pytest.mark.parametrize(
    "value",
    [torch.tensor(0.1), {"a": 1}, {1, 2}, _MyFloat(0.1), (0.9, torch.tensor(0.99)), b"x", 1j],
)
def test_non_plain_values_are_not_encoded(value: object) -> None:
    assert encode_updates({0: {"lr": 0.1, "x": value}}) is None


def test_non_str_option_keys_are_not_encoded() -> None:
    assert encode_updates({0: {1: 0.1}}) is None  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "payload",
    [
        b"[1]",
        b'{"x": {}}',
        b'{"0": 3}',
        b'{"0": {"a": {"tuple": 1}}}',
        b'{"0": {"a": {"b": []}}}',
        b"{",
        b"\xff",
    ],
)
def test_malformed_payloads_are_rejected(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_updates(payload)


def test_request_layout_is_fixed_little_endian() -> None:
    token = bytes(range(16))
    data = pack_request(STEP, 0x0102030405060708, token, -2, b"{}")
    assert data[:4] == b"SKRS" and data[4] == 1 and data[5] == STEP
    assert data[6:14] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert data[14:30] == token
    assert struct.unpack("<q", data[30:38]) == (-2,)
    assert struct.unpack("<I", data[38:42]) == (2,)
    assert data[42:] == b"{}"


@pytest.mark.parametrize(
    ("value", "on"),
    [
        (None, True),
        ("1", True),
        ("0", False),
        (" OFF ", False),
        ("false", False),
        ("no", False),
        ("yes", True),
    ],
)
def test_env_var(monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    assert enabled() is on


def test_wait_limit() -> None:
    assert wait_limit(None, 60.0) == 60.0
    assert wait_limit(None, 0.0) is None  # the agent's "no limit"
    assert wait_limit(0.5, 60.0) == 0.5


def test_reported_addresses_skip_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    infos = [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0))
        for ip in ("127.0.1.1", "10.0.0.5", "10.0.0.5", "192.168.1.2")
    ]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: infos)
    assert _channel._addresses("h") == ["10.0.0.5", "192.168.1.2"]


# -- a server with a fake owner optimizer ---------------------------------------------------------


class _Target:
    """Stands in for ``_owner._LocalOptimizer``."""

    def __init__(self) -> None:
        self.token = secrets.token_bytes(16)
        self.calls: list[tuple[int, Any]] = []
        self.delay = 0.0
        self.fail: Exception | None = None

    def direct_step(self, context_id: int, updates: Any) -> None:
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        self.calls.append((context_id, updates))


def _conn_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "shardkit-rpc-step-conn"}


@pytest.fixture
def served() -> Iterator[tuple[_Target, DirectSteps, Any]]:
    target = _Target()
    server = _channel._StepServer({7: target}.get, lambda h: f"no DistributedOptimizer {h}")
    direct = DirectSteps({"w": (server.endpoint, 7, target.token)})
    try:
        yield target, direct, server
    finally:
        direct.close()
        server.close()


def _step(
    direct: DirectSteps, cid: int, updates: Any = None, limit: float = 10.0
) -> BaseException | None:
    deadline = time.monotonic() + limit
    request = direct.send("w", cid, updates, deadline)
    assert request is not None
    return direct.finish(request, deadline, limit)


def test_step_round_trip_and_connection_reuse(served: tuple[_Target, DirectSteps, Any]) -> None:
    target, direct, _ = served
    updates = {
        0: {
            "betas": (0.8, 0.9),
            "lr": math.inf,
            "nesterov": True,
            "foreach": None,
            "names": ["a", (1, 2.5)],
        }
    }
    assert _step(direct, 11, updates) is None
    assert _step(direct, -12) is None
    assert target.calls[1] == (-12, None)
    cid, got = target.calls[0]
    assert cid == 11 and _identical(got[0]["betas"], (0.8, 0.9))
    assert _identical(got[0]["names"], ["a", (1, 2.5)]) and got[0]["lr"] == math.inf
    assert direct.sent == {"w": 2}
    assert len(direct._idle["w"]) == 1  # one connection, reused


def test_owner_failure_comes_back_with_type_and_traceback(
    served: tuple[_Target, DirectSteps, Any],
) -> None:
    target, direct, _ = served
    target.fail = ValueError("boom")
    error = _step(direct, 1)
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("ValueError: boom") and "Owner traceback" in str(error)
    target.fail = None
    assert _step(direct, 2) is None  # the connection survived the failure
    assert len(direct._idle["w"]) == 1


def test_timeout_drops_the_connection_and_the_next_step_reconnects(
    served: tuple[_Target, DirectSteps, Any],
) -> None:
    target, direct, _ = served
    target.delay = 3.0
    start = time.monotonic()
    error = _step(direct, 1, limit=0.2)
    assert isinstance(error, TimeoutError) and "0.2s" in str(error)
    assert time.monotonic() - start < 2.0  # gave up long before the owner's 3 s step finished
    assert direct._idle["w"] == []
    target.delay = 0.0
    assert _step(direct, 2) is None  # a fresh connection (this fake owner has no queue)
    deadline = time.monotonic() + 10
    while len(target.calls) < 2:  # the timed-out step still completes on the owner
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [c for c, _ in target.calls] == [2, 1]


def test_tensor_updates_fall_back_without_sending(served: tuple[_Target, DirectSteps, Any]) -> None:
    _, direct, _ = served
    assert direct.send("w", 1, {0: {"lr": torch.tensor(0.1)}}, None) is None
    assert direct.sent == {"w": 0}


def test_a_broken_idle_connection_is_replaced_before_sending(
    served: tuple[_Target, DirectSteps, Any],
) -> None:
    target, direct, _ = served
    assert _step(direct, 1) is None
    direct._idle["w"][0].close()
    assert _step(direct, 2) is None
    assert [c for c, _ in target.calls] == [1, 2]


def test_unreachable_owner_warns_once(served: tuple[_Target, DirectSteps, Any]) -> None:
    _, direct, _ = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (host, _, _), handle, token = direct._routes["w"]
    direct._routes["w"] = ((host + "-elsewhere", ["127.0.0.1"], port), handle, token)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert direct.send("w", 1, None, None) is None
        assert direct.send("w", 2, None, None) is None
    assert (
        len(caught) == 1 and "'w'" in str(caught[0].message) and ENV_VAR in str(caught[0].message)
    )


def test_a_wrong_server_fails_the_handshake(served: tuple[_Target, DirectSteps, Any]) -> None:
    _, direct, _ = served
    (host, addresses, port), handle, _ = direct._routes["w"]
    direct._routes["w"] = ((host, addresses, port), handle, bytes(16))  # not this server's token
    with pytest.warns(RuntimeWarning, match="wrong token"):
        assert direct.send("w", 1, None, None) is None


def test_concurrent_threads_get_their_own_connections(
    served: tuple[_Target, DirectSteps, Any],
) -> None:
    target, direct, _ = served
    target.delay = 0.002
    errors: list[BaseException | None] = []

    def run(base: int) -> None:
        errors.extend(_step(direct, base + i) for i in range(20))

    pool = [threading.Thread(target=run, args=(100 * t,)) for t in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert errors == [None] * 80
    assert sorted(c for c, _ in target.calls) == sorted(
        100 * t + i for t in range(4) for i in range(20)
    )
    assert 1 <= len(direct._idle["w"]) <= 4


def test_close_ends_the_owner_threads(served: tuple[_Target, DirectSteps, Any]) -> None:
    _, direct, _ = served
    # Connection threads of earlier tests' servers may still be winding down: only the thread
    # this test's step starts is followed, by identity.
    before = _conn_threads()
    assert _step(direct, 1) is None
    started = _conn_threads() - before
    assert len(started) == 1, started
    (thread,) = started
    direct.close()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_raw_requests_are_checked(
    served: tuple[_Target, DirectSteps, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, _, server = served
    address = ("127.0.0.1", server.endpoint[2])
    with socket.create_connection(address, timeout=5) as sock:  # oversized payload: refused
        sock.sendall(pack_request(STEP, 7, target.token, 1)[:-4] + struct.pack("<I", 1 << 30))
        status, message = read_reply(sock)
        assert status == ERROR and "payload of" in message
        assert sock.recv(1) == b""
    with socket.create_connection(address, timeout=5) as sock:  # malformed JSON: error, kept
        sock.sendall(pack_request(STEP, 7, target.token, 1, b"{nope"))
        status, message = read_reply(sock)
        assert status == ERROR and message.startswith("JSONDecodeError"), message
        sock.sendall(pack_request(HELLO, 7, target.token, 0))
        assert read_reply(sock) == (OK, "")
    assert target.calls == []
    monkeypatch.setattr(_channel, "_UNAUTHENTICATED_IDLE_S", 0.2)
    with socket.create_connection(address, timeout=5) as sock:  # silent: dropped
        start = time.monotonic()
        assert sock.recv(1) == b""
        assert time.monotonic() - start < 3
