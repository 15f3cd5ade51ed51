"""The transport of the call agreement: a bounded reduction of a few integers per rank through
the c10d store, leaving nothing pending when it gives up.

[Note: Agreement over the store]
The call agreement ([Note: Call agreement] in ``_agreement.py``) must be able to give up: a rank
that calls a collective alone raises after ``collective_timeout``. A Gloo collective waited on
with a timeout cannot be dropped: its worker thread waits on, and ``~ProcessGroupGloo`` joins it
when the process ends, so the rank that raised could never exit while the others lived (they
wait in their own collective, e.g. ``dist.barrier()``, for the process group's 30-minute
timeout). ``abort()`` / ``destroy_process_group`` of that group do not end the wait either
(measured on torch 2.13). So the agreement runs on the c10d store every process group is built
from (torchrun's TCPStore, a FileStore, ...), where a wait has a real timeout:

- *Namespace*: one channel per process group and process, under
  ``shardkit.optim/agree/<group name>/<token>/`` of the default store, where ``token`` is a
  random id rank 0 of the group draws when the channel is made and gives to the others with
  one object all-gather over the group (at the construction of the first ShardedOptimizer
  over it, where every rank is anyway). torch reuses group names (after
  ``destroy_process_group()``; torchrun's store outlives a process group), so the name alone
  could meet the keys of an earlier group.
- *Sequence*: every rank numbers its exchanges on a channel 0, 1, 2, ...; every rank makes the
  same agreements in the same order (that is what they agree on), so exchange ``k`` of every
  rank meets in the keys ``k/...``.
- *One exchange*: each rank sets its record ``k/<group rank>`` and adds 1 to the counter
  ``k/n``. The rank whose add returns the group size came last: it reads every record (one
  ``multi_get``), reduces them (MAX per column, and which ranks passed which first value when
  those differ) and sets ``k/out``. The others wait for ``k/out`` alone (bounded by the
  timeout) and read it. So the store does O(N) work per exchange (N records read once, one
  small outcome read N times), not the O(N^2) of every rank reading every record.
- *Giving up leaves nothing behind*: a rank whose wait timed out adds ``2**40`` to ``k/n``. If
  its add shows that every rank had arrived, the last one is about to set ``k/out``: it waits
  for it and goes on as if nothing happened. Otherwise it has made ``k/n`` unreachable (no
  add can return the group size any more), so nobody will reduce: if it was the first to do so
  it sets ``k/out`` to a "gave up" record (itself, its record, how long it waited, which ranks
  had not posted theirs). Every rank still waiting wakes and raises; a rank that arrives later
  sees the counter past ``2**40``, reads that record and raises at once, naming the rank and
  the call that gave up. So every rank decides the same way about exchange ``k``: all read the
  same outcome, or all raise.
- *Cleanup*: ``k/out`` exists only once the last rank has read every record, so each rank
  deletes its own record right after reading ``k/out``; a rank sets record ``k`` only after it
  has read ``k/out`` of every earlier exchange, so the last rank of ``k`` deletes ``k-1/n`` and
  ``k-1/out``, and those of the exchanges it saw given up (they had no last rank). A channel
  holds two keys between exchanges, whatever the number of steps or failures.
- *Waiting*: a TCPStore wait is answered by the server the moment the key exists. It holds the
  client's lock while it waits, so each channel uses its own client (``Store.clone()``) and
  never blocks torch's own users of the store (NCCL's watchdog). FileStore's own wait polls
  every 10 ms; a FileStore channel polls ``check`` instead, from 20 us backing off to 1 ms.
- *Cost*: five store round trips per rank (set, add, wait, get, delete; the last rank reads
  the records and sets the outcome instead of waiting); no GPU sync with NCCL; nothing for a
  group of one. Measured in the README (``benchmarks/bench_agreement.py``).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from shardkit.optim._torch_compat import default_store
from shardkit.partition import all_gather_objects
from torch.distributed.distributed_c10d import PrefixStore, Store

__all__ = ["Exchanged", "GaveUp", "channel", "exchange"]

_NAMESPACE = "shardkit.optim/agree"
_GAVE_UP = 1 << 40  # added to the counter by a rank that gives up: unreachable afterwards
_POLL_FIRST_S = 2e-5
_POLL_MAX_S = 1e-3

_StoreTimeout: type[Exception] = getattr(dist, "DistStoreError", RuntimeError)
_FILE_STORE: type[Any] = getattr(dist, "FileStore", type(None))


@dataclass(frozen=True)
class GaveUp:
    """The outcome a rank that gave up waiting publishes."""

    rank: int
    """Its rank in the group."""
    values: tuple[int, ...]
    """The record it had posted itself (its call first)."""
    waited_s: float
    """How long it waited, in seconds."""
    missing: tuple[int, ...]
    """The group ranks whose records it had not seen."""


@dataclass(frozen=True)
class Exchanged:
    """The outcome of one exchange, the same on every rank (or a :class:`GaveUp`)."""

    maxes: tuple[int, ...]
    """The MAX of every column of the records (empty with :attr:`gave_up`)."""
    by_first: dict[int, tuple[int, ...]] | None
    """When the ranks' first values differ: the group ranks that passed each one."""
    gave_up: GaveUp | None
    """Set when a rank gave up waiting: every rank then raises."""
    late: bool
    """With :attr:`gave_up`: this rank arrived after it gave up (it was not waited for)."""


def _encode_outcome(maxes: tuple[int, ...], by_first: dict[int, tuple[int, ...]] | None) -> str:
    return "O" + json.dumps([list(maxes), None if by_first is None else list(by_first.items())])


def _encode_gave_up(g: GaveUp) -> str:
    return "G" + json.dumps([g.rank, list(g.values), g.waited_s, list(g.missing)])


def _decode(raw: bytes) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]] | None] | GaveUp:
    text = raw.decode()
    try:
        body: list[Any] = json.loads(text[1:])
        if text[:1] == "O":
            maxes, pairs = body
            by_first = None if pairs is None else {int(k): tuple(v) for k, v in pairs}
            return tuple(int(v) for v in maxes), by_first
        if text[:1] == "G":
            rank, values, waited_s, missing = body
            return GaveUp(int(rank), tuple(values), float(waited_s), tuple(missing))
    except (ValueError, TypeError):
        pass
    raise RuntimeError(
        f"shardkit.optim: unexpected agreement record {raw[:60]!r} in the c10d store (another "
        f"program writing under {_NAMESPACE}/?)"
    )


def _innermost(store: Store) -> Store:
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


class _Channel:
    """The exchanges of one process group in this process. See [Note: Agreement over the store]."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.seq = 0
        self.lock = threading.Lock()
        self.given_up: list[int] = []  # exchanges whose keys no last rank dropped
        if self.world == 1:
            return
        base = default_store()
        self.poll = isinstance(_innermost(base), _FILE_STORE)
        drawn = uuid.uuid4().hex if self.rank == 0 else None
        token = all_gather_objects(drawn, group)[0]  # See [Note: Object collectives without NumPy]
        client = base
        if not self.poll:  # a client of our own for the blocking waits
            clone = getattr(base, "clone", None)
            try:
                client = clone() if clone is not None else base
            except (RuntimeError, NotImplementedError):
                client = base
        self.store = PrefixStore(f"{_NAMESPACE}/{group.group_name}/{token}/", client)

    def exchange(self, values: tuple[int, ...], timeout: timedelta) -> Exchanged:
        if self.world == 1:
            return Exchanged(values, None, None, False)
        with self.lock:
            k = self.seq
            self.seq += 1
            mine, out = f"{k}/{self.rank}", f"{k}/out"
            self.store.set(mine, ",".join(str(v) for v in values))
            arrived = self.store.add(f"{k}/n", 1)
            if arrived == self.world:
                raw = self._reduce(k).encode()
            elif arrived > self.world:  # the counter was given up on before this rank came
                raw = self._read(out, timeout)
            elif self._wait(out, timeout):
                raw = self.store.get(out)
            else:
                raw = self._give_up(k, values, timeout)
            self.store.delete_key(mine)
            decoded = _decode(raw)
            if isinstance(decoded, GaveUp):
                self.given_up += [k - 1, k]  # it had no last rank to drop ``k - 1``'s keys
                late = arrived > self.world or self.rank in decoded.missing
                return Exchanged((), None, decoded, late)
            maxes, by_first = decoded
            return Exchanged(maxes, by_first, None, False)

    def _reduce(self, k: int) -> str:
        """The last rank to arrive: reduce every record, publish, drop ``k - 1``'s keys."""
        records = [
            tuple(int(v) for v in raw.decode().split(","))
            for raw in self.store.multi_get([f"{k}/{r}" for r in range(self.world)])
        ]
        maxes = tuple(max(column) for column in zip(*records, strict=True))
        by_first: dict[int, tuple[int, ...]] | None = None
        if any(r[0] != records[0][0] for r in records):
            ranks: dict[int, list[int]] = {}
            for r, record in enumerate(records):
                ranks.setdefault(record[0], []).append(r)
            by_first = {first: tuple(rs) for first, rs in ranks.items()}
        text = _encode_outcome(maxes, by_first)
        self.store.set(f"{k}/out", text)
        for old in sorted({k - 1, *self.given_up} - {-1}):
            self.store.delete_key(f"{old}/n")
            self.store.delete_key(f"{old}/out")
        self.given_up.clear()
        return text

    def _wait(self, key: str, timeout: timedelta) -> bool:
        """Whether ``key`` exists within ``timeout``."""
        if not self.poll:
            try:
                self.store.wait([key], timeout)
            except _StoreTimeout:
                return False
            return True
        deadline = time.monotonic() + timeout.total_seconds()
        delay = _POLL_FIRST_S
        while not self.store.check([key]):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(2 * delay, _POLL_MAX_S)
        return True

    def _read(self, key: str, timeout: timedelta) -> bytes:
        """``key``, which another rank sets at once (it has already decided to)."""
        if not self._wait(key, timeout):
            raise RuntimeError(
                f"shardkit.optim: the call agreement's outcome {key} never appeared in the c10d "
                f"store (the rank that was to publish it died?)"
            )
        return self.store.get(key)

    def _give_up(self, k: int, values: tuple[int, ...], timeout: timedelta) -> bytes:
        """This rank waited ``timeout`` for ``k/out``: give the exchange up, unless every rank
        arrived meanwhile. Returns the outcome."""
        arrived = self.store.add(f"{k}/n", _GAVE_UP) - _GAVE_UP
        if arrived >= self.world:  # every rank came (==), or another rank gave up first (>)
            return self._read(f"{k}/out", timeout)
        missing = tuple(r for r in range(self.world) if not self.store.check([f"{k}/{r}"]))
        record = GaveUp(self.rank, values, timeout.total_seconds(), missing)
        text = _encode_gave_up(record)
        self.store.set(f"{k}/out", text)
        return text.encode()


_CHANNELS: dict[int, tuple[weakref.ref[dist.ProcessGroup], _Channel]] = {}
_CHANNELS_LOCK = threading.Lock()


def channel(group: dist.ProcessGroup) -> _Channel:
    """The agreement channel of ``group`` in this process. Making it (the first call on a
    group) is a collective of ``group``: ShardedOptimizer's constructor makes it."""
    entry = _CHANNELS.get(id(group))
    if entry is not None and entry[0]() is group:
        return entry[1]
    with _CHANNELS_LOCK:
        entry = _CHANNELS.get(id(group))
        if entry is not None and entry[0]() is group:
            return entry[1]
        made = _Channel(group)
        key = id(group)

        def _forget(ref: weakref.ref[dist.ProcessGroup]) -> None:
            if _CHANNELS.get(key, (None,))[0] is ref:
                _CHANNELS.pop(key, None)

        _CHANNELS[key] = (weakref.ref(group, _forget), made)
        return made


def exchange(group: dist.ProcessGroup, values: tuple[int, ...], timeout: timedelta) -> Exchanged:
    """Every rank of ``group`` posts ``values`` (ints, the same count on every rank); each gets
    the same reduction (:class:`Exchanged`), or learns that a rank gave up waiting after
    ``timeout`` (this one or another). Collective over ``group``'s ranks, through the c10d
    store only. See [Note: Agreement over the store]."""
    return channel(group).exchange(values, timeout)
