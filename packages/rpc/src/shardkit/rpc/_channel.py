"""The direct step channel: ``DistributedOptimizer.step`` over a plain TCP socket, without RPC.

Owner side: :func:`serve` starts this process's step server (once) and returns its endpoint.
Trainer side: :class:`DirectSteps` holds the connections of one DistributedOptimizer.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import os
import socket
import struct
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "ENV_VAR",
    "ERROR",
    "HELLO",
    "OK",
    "STEP",
    "DirectSteps",
    "Endpoint",
    "ProtocolError",
    "StepTarget",
    "decode_updates",
    "enabled",
    "encode_updates",
    "pack_request",
    "read_reply",
    "serve",
    "wait_limit",
]

# [Note: Direct step channel]
# Why: a Python RPC round trip (pickled call, TensorPipe, the GIL on both ends) costs more than
# torch's whole TorchScript step (measured: ~0.8 ms for an empty Python RPC between two processes
# vs 0.6-0.7 ms for torch's step; a blocking TCP round trip is ~70 us). torch has only two RPC
# paths that skip Python: TorchScript functions (excluded: any torch.optim class must work) and
# builtin operators, which must be `aten::` ops (a custom `torch.library` op is refused by
# `matchBuiltinOp`). So `step` bypasses RPC: every owner runs a small TCP server (one per process,
# started lazily by `_remote_new`, port 0 on all interfaces, a daemon thread per connection,
# TCP_NODELAY), and the trainer sends each owner one fixed-size request per step.
#
# What it carries: only `step`. A request is a little-endian header (magic + version, kind,
# optimizer handle u64, token 16 bytes, context id i64, payload length u32) plus an optional
# UTF-8 JSON payload with the hyper-parameter updates of [Note: Hyper-parameter forwarding];
# the reply is a status byte, a length and a UTF-8 message ("Type: message" and the owner's
# traceback on failure). The owner runs the step through the optimizer's `_SerialQueue` exactly
# as `_remote_step` does, so channel steps, RPC steps and state_dict/load_state_dict stay
# serialised and exact ([Note: Per-optimizer serial queue]); `dist_autograd.get_gradients` works
# from the handler thread because the context container is process-global (pinned by a test).
# Everything else (construction, state_dict, load_state_dict) stays on RPC, which also owns the
# optimizer's lifetime ([Note: Optimizer handles]): the server looks handles up per request and
# never keeps an optimizer alive.
#
# Security: nothing on this channel is unpickled or evaluated. Each owner optimizer has its own
# random 128-bit token, handed to the trainer over RPC and compared with `hmac.compare_digest`;
# a wrong token gets an error reply and the connection is closed, an unknown handle an error
# reply; nothing is parsed beyond the fixed header before the token matched, lengths are
# bounded, and an unauthenticated connection is dropped after a few idle seconds. The worst a
# peer without the token can do is open connections. Like TensorPipe, the channel is not
# encrypted; TensorPipe's own port accepts pickled Python (arbitrary code) from anyone who can
# reach it, so this port adds no exposure of that kind.
#
# Fallback rules (the result is the same either way, only slower): the channel is off on an
# owner, and for a trainer, when SHARDKIT_RPC_DIRECT_STEP=0 there (read when the owner builds
# its optimizer and when the trainer builds the DistributedOptimizer), or when the server could
# not start; an owner the trainer cannot connect to (2 s connect + handshake, 127.0.0.1 when the
# hostnames match, else the owner's reported addresses) is warned about once and stepped over
# RPC from then on; a step whose updates are not plain JSON values (e.g. a tensor lr) goes over
# RPC for that step. A request that could not be sent whole was never applied and is retried on
# a fresh connection; once sent, a timed-out or broken connection is closed (its state is
# unknown), reported as that owner's failure, and the next step reconnects.

ENV_VAR = "SHARDKIT_RPC_DIRECT_STEP"

_MAGIC = b"SKRS"
_VERSION = 1
HELLO = 1  # check handle + token, no step: the trainer's handshake on every new connection
STEP = 2
_REQUEST = struct.Struct("<4sBBQ16sqI")  # magic, version, kind, handle, token, context id, length
_REPLY = struct.Struct("<BI")  # status (0 ok, 1 error), message length
OK, ERROR = 0, 1
_MAX_PAYLOAD = 1 << 20
_MAX_MESSAGE = 1 << 16
_UNAUTHENTICATED_IDLE_S = 10.0
_CONNECT_TIMEOUT_S = 2.0

# (hostname, IPv4 addresses other than loopback, port)
Endpoint = tuple[str, list[str], int]
Updates = dict[int, dict[str, Any]]


def enabled() -> bool:
    """Whether the channel is enabled in this process (``SHARDKIT_RPC_DIRECT_STEP`` not 0/false)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


class ProtocolError(ConnectionError):
    """The peer sent something that is not this channel's protocol."""


# -- hyper-parameter payload -------------------------------------------------------------------


class _NotJson(Exception):
    pass


def _encode_value(value: Any) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [_encode_value(v) for v in value]
    if kind is tuple:  # JSON has no tuple: an object marks one (no other value is an object)
        return {"tuple": [_encode_value(v) for v in value]}
    raise _NotJson


def encode_updates(updates: Updates) -> bytes | None:
    """``updates`` as the channel's JSON payload, or ``None`` if some value is not plain data.

    Plain data: ``None``, ``bool``, ``int``, ``float`` (``inf``/``nan`` included), ``str`` and
    lists/tuples of those (exact types, so every value comes back as the same type and value).
    """
    try:
        doc = {}
        for group, changes in updates.items():
            if type(group) is not int or any(type(k) is not str for k in changes):
                return None
            doc[str(group)] = {k: _encode_value(v) for k, v in changes.items()}
    except _NotJson:
        return None
    return json.dumps(doc, separators=(",", ":")).encode()


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    if isinstance(value, dict):
        items = value.get("tuple")
        if len(value) != 1 or not isinstance(items, list):
            raise ValueError(f"expected {{'tuple': [...]}}, got {value!r:.80}")
        return tuple(_decode_value(v) for v in items)
    return value


def decode_updates(payload: bytes) -> Updates | None:
    """Inverse of :func:`encode_updates`; raises ``ValueError`` for a malformed payload."""
    if not payload:
        return None
    doc = json.loads(payload.decode())
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object of param groups, got {type(doc).__name__}")
    updates: Updates = {}
    for group, changes in doc.items():
        if not group.isdigit() or not isinstance(changes, dict):
            raise ValueError(
                f"expected '<group index>': {{options}}, got {group!r}: {changes!r:.80}"
            )
        updates[int(group)] = {k: _decode_value(v) for k, v in changes.items()}
    return updates


# -- wire format ---------------------------------------------------------------------------------


def pack_request(
    kind: int, handle: int, token: bytes, context_id: int, payload: bytes = b""
) -> bytes:
    """One request: the fixed header, then ``payload``. See [Note: Direct step channel]."""
    return _REQUEST.pack(_MAGIC, _VERSION, kind, handle, token, context_id, len(payload)) + payload


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly ``n`` bytes, or ``None`` if the peer closed the connection before the first one."""
    data = sock.recv(n)
    if not data:
        return None
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ProtocolError(f"connection closed after {len(data)} of {n} bytes")
        data += more
    return data


def read_reply(sock: socket.socket) -> tuple[int, str]:
    """(status, message) of one reply; ``ConnectionError`` if the connection broke or closed."""
    header = _recv_exact(sock, _REPLY.size)
    if header is None:
        raise ConnectionError("the owner closed the connection")
    status, length = _REPLY.unpack(header)
    if status not in (OK, ERROR) or length > _MAX_MESSAGE:
        raise ProtocolError(f"malformed reply header (status {status}, length {length})")
    body = _recv_exact(sock, length) if length else b""
    if length and body is None:
        raise ProtocolError("connection closed before the reply message")
    return status, (body or b"").decode(errors="replace")


def _reply(sock: socket.socket, status: int, message: str = "") -> None:
    data = message.encode(errors="replace")
    if len(data) > _MAX_MESSAGE:  # keep the head (type: message) and the tail of the traceback
        data = data[:2048] + b"\n[...]\n" + data[-(_MAX_MESSAGE - 2100) :]
    sock.sendall(_REPLY.pack(status, len(data)) + data)


# -- owner side ----------------------------------------------------------------------------------


class StepTarget(Protocol):
    """What the server needs from an owner-side optimizer (``_owner._LocalOptimizer``)."""

    token: bytes

    def direct_step(self, context_id: int, updates: Updates | None) -> None:
        """Run one step through the optimizer's serial queue and wait for it."""
        ...


class _StepServer:
    """This process's listening socket, its accept thread and one handler thread per connection."""

    def __init__(
        self, lookup: Callable[[int], StepTarget | None], unknown: Callable[[int], str]
    ) -> None:
        self._lookup, self._unknown = lookup, unknown
        self._listener = socket.create_server(("", 0), family=socket.AF_INET, backlog=128)
        hostname = socket.gethostname()
        self.endpoint: Endpoint = (hostname, _addresses(hostname), self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name="shardkit-rpc-step-accept", daemon=True).start()

    def close(self) -> None:
        """Stop accepting connections (open ones are served until their peers close them)."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn,), name="shardkit-rpc-step-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(_UNAUTHENTICATED_IDLE_S)
                authenticated = False
                while True:
                    verdict = self._one(conn, authenticated)
                    if verdict is None:
                        return
                    if verdict and not authenticated:
                        authenticated = True
                        conn.settimeout(None)  # a trainer may idle for long between steps
            except OSError:  # closed, reset or idle before authenticating: drop the connection
                return

    def _one(self, conn: socket.socket, authenticated: bool) -> bool | None:
        """Serve one request. Returns ``None`` to close, else whether the token matched."""
        header = _recv_exact(conn, _REQUEST.size)
        if header is None:
            return None
        magic, version, kind, handle, token, context_id, length = _REQUEST.unpack(header)
        if magic != _MAGIC or version != _VERSION or kind not in (HELLO, STEP):
            _reply(
                conn, ERROR, f"ProtocolError: not a shardkit-rpc step request (version {_VERSION})"
            )
            return None
        if length > _MAX_PAYLOAD:
            _reply(
                conn, ERROR, f"ProtocolError: payload of {length} bytes (at most {_MAX_PAYLOAD})"
            )
            return None
        target = self._lookup(handle)
        if target is None:
            if length and _recv_exact(conn, length) is None:
                return None
            _reply(conn, ERROR, f"RuntimeError: {self._unknown(handle)}")
            return authenticated
        if not hmac.compare_digest(token, target.token):
            _reply(conn, ERROR, f"PermissionError: wrong token for optimizer handle {handle}")
            return None
        payload = _recv_exact(conn, length) if length else b""
        if payload is None:
            return None
        if kind == HELLO:
            _reply(conn, OK)
            return True
        try:
            target.direct_step(context_id, decode_updates(payload))
        except Exception as err:
            text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            _reply(conn, ERROR, f"{type(err).__name__}: {err}\n\nOwner traceback:\n{text}")
        else:
            _reply(conn, OK)
        return True


def _addresses(hostname: str) -> list[str]:
    """Non-loopback IPv4 addresses of this host, for trainers on other hosts."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for *_, sockaddr in socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM):
            ip = str(sockaddr[0])
            if not ip.startswith("127.") and ip not in found:
                found.append(ip)
    return found


_server: _StepServer | None = None
_server_lock = threading.Lock()
_server_warned = False


def serve(
    lookup: Callable[[int], StepTarget | None], unknown: Callable[[int], str]
) -> Endpoint | None:
    """This process's step server endpoint, starting the server on first use.

    Args:
        lookup: Handle -> the optimizer it names, or ``None`` (freed / never existed).
        unknown: Handle -> the error message for an unknown handle.

    Returns:
        The endpoint, or ``None`` when the channel is disabled or the server cannot start (warned
        once; steps then go over RPC).
    """
    global _server, _server_warned
    if not enabled():
        return None
    with _server_lock:
        if _server is None:
            try:
                _server = _StepServer(lookup, unknown)
            except OSError as err:
                if not _server_warned:
                    _server_warned = True
                    warnings.warn(
                        f"shardkit.rpc: could not start the direct step server on "
                        f"{socket.gethostname()} ({err}); DistributedOptimizer steps to this "
                        f"worker use RPC (slower). Set {ENV_VAR}=0 to silence this.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                return None
        return _server.endpoint


# -- trainer side --------------------------------------------------------------------------------


class _Request:
    """One step request in flight to one owner."""

    __slots__ = ("owner", "sock")

    def __init__(self, owner: str, sock: socket.socket) -> None:
        self.owner, self.sock = owner, sock


class DirectSteps:
    """The step channel of one trainer-side DistributedOptimizer to every owner that offered one.

    Connections are pooled per owner: a step takes an idle connection (or opens one) for each
    owner and gives it back after the reply, so each trainer thread stepping concurrently has its
    own connection, and there are never more connections than concurrent steps. See
    [Note: Direct step channel].

    Args:
        routes: owner name -> (its server's endpoint, the optimizer handle, its token).
    """

    def __init__(self, routes: dict[str, tuple[Endpoint, int, bytes]]) -> None:
        self._routes = dict(routes)
        self._idle: dict[str, list[socket.socket]] = {owner: [] for owner in routes}
        self._lock = threading.Lock()
        self._closed = False
        self._hostname = socket.gethostname()
        # Step requests sent per owner (tests and benchmarks read it).
        self.sent: dict[str, int] = dict.fromkeys(routes, 0)

    def send(
        self, owner: str, context_id: int, updates: Updates | None, deadline: float | None
    ) -> _Request | None:
        """Send ``owner``'s step request; ``None`` means "step this owner over RPC".

        ``None`` when the owner has no (reachable) channel, when ``updates`` are not plain data,
        or when the request could not be sent whole on a fresh connection (never applied then).
        """
        route = self._routes.get(owner)
        if route is None:
            return None
        payload = b""
        if updates:
            encoded = encode_updates(updates)
            if encoded is None:
                return None
            payload = encoded
        _, handle, token = route
        data = pack_request(STEP, handle, token, context_id, payload)
        with self._lock:
            idle = self._idle.get(owner)
            sock = idle.pop() if idle else None
        for fresh in (False, True):
            if sock is None:
                if not fresh:
                    continue
                sock = self._connect(owner)
                if sock is None:
                    return None
            try:
                sock.settimeout(_remaining(deadline))
                sock.sendall(data)
            except OSError:  # not sent whole, so never applied: retry once on a fresh connection
                sock.close()
                sock = None
                continue
            with self._lock:
                self.sent[owner] += 1
            return _Request(owner, sock)
        return None

    def finish(
        self, request: _Request, deadline: float | None, limit: float | None
    ) -> BaseException | None:
        """Wait for ``request``'s reply; the owner's failure as an exception, or ``None``."""
        sock = request.sock
        try:
            sock.settimeout(_remaining(deadline))
            status, message = read_reply(sock)
        except TimeoutError:
            sock.close()
            waited = "the time limit" if limit is None else f"{limit:g}s"
            return TimeoutError(
                f"no reply to the step within {waited} over the direct step channel; the "
                "connection was dropped (the owner may still apply the step)"
            )
        except OSError as err:
            sock.close()
            return ConnectionError(
                f"the direct step channel broke before the reply ({type(err).__name__}: {err}); "
                "the step may or may not have been applied"
            )
        self._release(request.owner, sock)
        return None if status == OK else RuntimeError(message)

    def _release(self, owner: str, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle[owner].append(sock)
                return
        sock.close()

    def _connect(self, owner: str) -> socket.socket | None:
        """A connection whose handshake succeeded, or ``None`` (then warn once, use RPC)."""
        (hostname, addresses, port), handle, token = self._routes[owner]
        candidates = ["127.0.0.1"] if hostname == self._hostname else []
        candidates += [a for a in addresses if a not in candidates]
        errors: list[str] = []
        for address in candidates:
            sock: socket.socket | None = None
            try:
                sock = socket.create_connection((address, port), timeout=_CONNECT_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(pack_request(HELLO, handle, token, 0))
                status, message = read_reply(sock)
                if status == OK:
                    return sock
                errors.append(f"{address}:{port}: {message}")
            except OSError as err:
                errors.append(f"{address}:{port}: {type(err).__name__}: {err}")
            if sock is not None:
                sock.close()
        with self._lock:
            if self._routes.pop(owner, None) is None:
                return None  # another thread already gave up on this owner and warned
        warnings.warn(
            f"shardkit.rpc: cannot reach the direct step channel of owner {owner!r} (host "
            f"{hostname!r}, tried {'; '.join(errors) or 'no address'}); steps to {owner!r} use RPC "
            f"from now on (same result, slower). Set {ENV_VAR}=0 to use RPC everywhere.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None

    def close(self) -> None:
        """Close every idle connection (in-flight ones are closed when they come back)."""
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle]
            for idle in self._idle.values():
                idle.clear()
        for sock in socks:
            sock.close()


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    return left if left > 1e-3 else 1e-3


def wait_limit(timeout: float | None, default: float) -> float | None:
    """Seconds a step may wait for the channel: ``timeout``, else ``default`` (0: no limit)."""
    limit = default if timeout is None else timeout
    return limit if limit > 0 and math.isfinite(limit) else None
