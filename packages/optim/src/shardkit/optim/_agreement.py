"""Agreement between the ranks of a ShardedOptimizer beyond the construction check.

[Note: Call agreement]
Every collective entry point of a ShardedOptimizer (``step()``, ``clip_grad_norm()``,
``consolidate_state_dict()``, ``state_dict(all_ranks=True)``, the implicit consolidation of
``state_dict()``) and of the drivers (ShardedDataParallel's backward, ``optimizer_state_dict()``,
...) starts with the same small agreement: a reduction (MAX) over the ranks of the optimizer's
group of six int64s ``[call, -call, digest, -digest, requires_grad changed, sparse gradient]``,
where ``call`` names the entry point. It runs on the c10d store the process group was built
from, never on a process group (see [Note: Agreement over the store] below),
bounded by ``collective_timeout`` (default 30 s), so that:

- a rank that enters a collective alone (the classic "state_dict() on rank 0 only") raises
  after the timeout, naming the call the other ranks must make and the ranks that did not
  come, and leaves nothing pending: it can exit (torchrun then ends the job) or go on, and the
  optimizer's process group stays usable. A rank that comes later raises at once, naming the
  rank that gave up and its call; a rank waiting in a collective of its own (``dist.barrier()``)
  ends when the process that raised exits (Gloo fails the collective; torchrun stops the job);
- ranks in *different* entry points (rank 0 in ``state_dict()``, rank 1 in ``step()``) all
  raise the same error naming both calls and which ranks made them, before either moves any
  tensor;
- sub groups agree the same way, on their own keys (nothing pairs with their collectives);
- the agreement needs no GPU synchronisation with NCCL (the store is on the CPU).

Every collective shardkit issues comes after an agreement that every rank passed, so the
collectives in flight when an agreement raises (ZeRO-2's reduce-scatters and param all-gathers,
the overlap hook's broadcasts) were issued by every rank and complete: none is left for
``~ProcessGroupGloo`` to wait on forever. One issued by a rank that then died fails when that
process ends (Gloo: "Connection closed by peer").

[Note: Per-step agreement]
Each rank steps only its own shard with its own copy of the hyper-parameters, so a rank whose
``lr`` (or betas, weight decay, ...) differs from the others' trains its shard with it, silently
(a schedule built from each rank's own loader length is enough). And a decision one rank takes
alone before a collective (repartition because ``requires_grad`` changed on that rank, an error
about a sparse gradient) leaves the others waiting in the next collective for the process
group's timeout. So the call agreement of every ``step()`` (see [Note: Call agreement]) carries
``digest``, a 62-bit hash of every param group's hyper-parameters, whether ``requires_grad``
changed on this rank and whether it saw a sparse gradient (or refuses the step). Unequal
digests (max != -max(-d)) raise on every rank with the differing values; a change of
``requires_grad`` on any rank repartitions on every rank; a sparse gradient on any rank raises
on every rank. A rank that never reaches ``step()`` makes the others raise after
``collective_timeout`` instead of hanging. The cost is one call agreement per step (a few store
round trips; figures in the README).

[Note: Param order fingerprint]
The construction check (``check_consistent``) compares shapes, dtypes and trainability in
order, so two same-shaped params passed in a different order on different ranks (a dict
iterated in another order) pass it, and every owner then broadcasts one param's values into the
other. At construction each rank also reduces every param to one number (its sum in fp64,
chunk by chunk: a cast of the whole param to fp64 is a transient of twice an fp32 param's bytes,
four times a bf16 one's, which CUDA's caching allocator then keeps: a 32 MiB block per 16 MiB
weight, measured on an H200; the chunks bound it by :data:`_FINGERPRINT_CHUNK` elements) and
compares the list's digest across ranks; if the lists differ and some rank's list is a
permutation of rank 0's among same-shaped params, every rank raises naming the swapped params.
Lists that differ otherwise (ranks initialised with different seeds, to be synchronised by DDP's
broadcast) are not an ordering error: they are logged once.

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

import hashlib
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from shardkit.checkpoint import REFUSED, Outcome, agreed_error, outcome, register_error_type
from shardkit.checkpoint import agree_outcome as _agree_outcome
from shardkit.optim._dist import global_rank
from shardkit.optim._placeholders import _ReducedGrad
from shardkit.optim._state import _hyperparams
from shardkit.optim._torch_compat import default_store
from shardkit.partition import all_gather_objects
from torch.distributed.distributed_c10d import PrefixStore, Store

__all__ = [
    "Exchanged",
    "GaveUp",
    "agree_call",
    "agree_outcome",
    "agree_values",
    "agreed_error",
    "channel",
    "describe_difference",
    "exchange",
    "hyperparam_digest",
    "hyperparams",
    "outcome",
    "register_call",
    "register_error_type",
]

hyperparams = _hyperparams
"""A param group's hyper-parameters: every key but ``params``."""

logger = logging.getLogger("shardkit.optim")

_warned_values = False
_FINGERPRINT_CHUNK = 1 << 20
"""Elements per fp64 partial sum of a param's fingerprint ([Note: Param order fingerprint])."""


def hyperparam_digest(param_groups: Sequence[dict[str, Any]]) -> int:
    """62-bit digest of every group's hyper-parameters (everything but ``params``)."""
    text = repr([sorted(_hyperparams(g).items(), key=lambda kv: kv[0]) for g in param_groups])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2


# [Note: One agreement module]
# Every cross-rank agreement of shardkit-optim, and of the distributions built on it
# (shardkit-overlap's registration, shardkit-ddp's bucket plan), goes through this module:
# :func:`agree_values` (every rank passes the same value, or every rank raises naming the
# difference), :func:`agree_outcome` (a local check failed on some rank: every rank raises that
# rank's error, with its type: shardkit-checkpoint's outcome agreement, see [Note: One outcome
# agreement], over the NumPy-free object gather), :func:`agree_call` (the bounded entry-point
# agreement of [Note: Call agreement], which also carries the hyper-parameter digest and the
# per-step flags). Each is one collective that every rank reaches whatever its local outcome,
# so a decision one rank takes alone never leaves the others waiting in a collective. The
# checkpoint functions (``_checkpoint.py``) decide with :func:`agreed_error` too, on outcomes
# they gather with their data (the checksums of a save) or with :func:`agree_outcome`, keeping
# their own messages through ``template``.


def agree_values(
    value: Any,
    group: dist.ProcessGroup,
    what: str,
    describe: Callable[[list[Any]], str] | None = None,
) -> list[Any]:
    """All-gathers a small picklable ``value``; raises on every rank if the ranks disagree.

    Args:
        value: this rank's value (compared with ``==``).
        group: the process group (every rank of it calls this).
        what: what the value is, for the message (e.g. ``"the bucket plan"``).
        describe: turns every rank's value into the message's detail (e.g. the first
            difference); default: each rank's value.

    Returns:
        Every rank's value, in rank order.

    Raises:
        ValueError: the values differ (on every rank), listing each rank's value.
    """
    gathered = all_gather_objects(value, group)  # See [Note: Object collectives without NumPy]
    if any(v != gathered[0] for v in gathered):
        if describe is not None:
            detail = describe(gathered)
        else:
            detail = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(gathered))
        raise ValueError(
            f"ranks disagree on {what}: {detail}. Every rank of the group must make the same "
            f"call with the same arguments."
        )
    return gathered


def agree_outcome(
    error: BaseException | Outcome,
    group: dist.ProcessGroup,
    what: str,
    *,
    template: str = REFUSED,
    default: type[Exception] = RuntimeError,
) -> None:
    """Raises on every rank the error of the first rank whose local check failed (if any):
    :func:`shardkit.checkpoint.agree_outcome` over the NumPy-free object gather (see [Note:
    Object collectives without NumPy]).

    Raises:
        Exception: on every rank, of the first failing rank's error type (a registered one,
            see :func:`shardkit.checkpoint.register_error_type`; others as ``default``).
    """
    _agree_outcome(error, group, what, template=template, default=default, gather_objects=_gather)


def _gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    return all_gather_objects(value, group)


# ---------------------------------------------------------------- the transport
# See [Note: Agreement over the store].

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


# ---------------------------------------------------------------- the call agreement
_NAMES: dict[int, str] = {}
"""Code -> name of every entry point that agrees with :func:`agree_call`, registered at import
time (so every rank knows every name, including calls it never makes itself)."""


def register_call(name: str) -> str:
    """Registers an entry point for :func:`agree_call` (at import time); returns ``name``.

    The code is a 62-bit hash of the name, the same on every rank.

    Raises:
        ValueError: another name has the same code (rename one).
    """
    code = _code(name)
    if _NAMES.setdefault(code, name) != name:
        raise ValueError(f"call names {name!r} and {_NAMES[code]!r} hash alike: rename one")
    return name


def _code(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 2


# The collective entry points of shardkit-optim, agreed with :func:`agree_call`.
STEP_CALL = register_call("ShardedOptimizer.step()")
CONSOLIDATE_CALL = register_call("ShardedOptimizer.consolidate_state_dict()")
IMPLICIT_CONSOLIDATE_CALL = register_call(
    "ShardedOptimizer.state_dict() (implicit consolidation onto every rank)"
)
SAVE_SHARDED_CALL = register_call("shardkit.optim.save_sharded()")
LOAD_SHARDED_CALL = register_call("shardkit.optim.load_sharded()")
MASTER_STATE_DICT_CALL = register_call("ShardedOptimizer.master_model_state_dict()")
CLIP_CALL = register_call("ShardedOptimizer.clip_grad_norm()")
REPARTITION_CALL = register_call(
    "ShardedOptimizer repartition (add_param_group / refresh_trainable / set_partition)"
)

DEFAULT_TIMEOUT = timedelta(seconds=30)
"""``collective_timeout``'s default. See [Note: Call agreement]."""


class _NeverRaised(Exception):
    """Stands in for ``torch.distributed.DistError`` where torch has none."""


_StoreError: type[Exception] = getattr(dist, "DistError", _NeverRaised)
"""What the c10d store raises when it fails (its wait timeouts are caught by the exchange)."""


def agree_call(
    call: str,
    group: dist.ProcessGroup,
    timeout: timedelta | None,
    *,
    digest: int = 0,
    changed: bool = False,
    flag: bool = False,
) -> tuple[int, int, int]:
    """The call agreement (see [Note: Call agreement]). Collective over ``group``'s ranks.

    It runs on the c10d store of the default process group (see [Note: Agreement over the
    store]): no collective of ``group`` is issued, and nothing is left pending when it raises.
    Only the first agreement on a group that no ShardedOptimizer was built over is also one
    object all-gather over ``group`` (it names the group's keys in the store), bounded by the
    group's own timeout only: make that first call where every rank is.

    Args:
        call: the entry point, registered with :func:`register_call`.
        group: the process group whose ranks agree.
        timeout: how long to wait for the other ranks (``None``: 30 s).
        digest: a value (``|digest| < 2**62``) every rank must pass alike, e.g. a hash of the
            hyper-parameters or a count of calls.
        changed, flag: per-rank booleans, OR-ed over the ranks.

    Returns:
        ``(digest equal on every rank, any rank changed, any rank flag)`` as ints 0/1.

    Raises:
        RuntimeError: ranks are in different entry points (on every rank, naming both), or
            some rank did not reach this call within ``timeout`` (on the ranks that waited,
            naming the call and the missing ranks; on a rank that comes later, at once, naming
            the rank that gave up and its call), or the c10d store failed.
    """
    code = _code(call)
    if code not in _NAMES:
        raise ValueError(f"{call!r} is not a registered call: register_call() it at import")
    wait = timeout if timeout is not None else DEFAULT_TIMEOUT
    try:
        done = exchange(group, (code, -code, digest, -digest, int(changed), int(flag)), wait)
    except _StoreError as e:
        raise RuntimeError(
            f"global rank {dist.get_rank()} called {call}, but its call agreement lost the c10d "
            f"store ({type(e).__name__}: {e}). The process serving the store (torchrun's agent, "
            f"or rank 0 with init_method env:// or tcp://) has probably ended: the job cannot go "
            f"on."
        ) from e
    if done.gave_up is not None:
        if done.late:
            raise _came_late(call, group, done.gave_up)
        raise _gave_up(call, group, wait, done.gave_up)
    hi, lo, top, low, any_changed, any_flag = done.maxes
    if hi != -lo:
        by_call = {
            _NAMES.get(c, "an unknown call"): _ranks_text(group, rs)
            for c, rs in (done.by_first or {}).items()
        }
        names = sorted(by_call) or sorted({_NAMES.get(hi, "?"), _NAMES.get(-lo, "?")})
        where = [f"{n} (global rank(s) {by_call[n]})" if n in by_call else n for n in names]
        raise RuntimeError(
            f"ranks of the group are in different collective calls: some in {where[0]}, "
            f"others in {', '.join(where[1:])} (this rank: {call}). Every rank must make the "
            f"same collective calls in the same order; a rank-dependent branch (e.g. `if rank "
            f"== 0: optimizer.state_dict()`, a backward or no_sync() on some ranks only) is the "
            f"usual cause."
        )
    return int(top == -low), any_changed, any_flag


def _ranks_text(group: dist.ProcessGroup, ranks: Sequence[int]) -> str:
    return str([global_rank(group, r) for r in ranks])


def _gave_up(call: str, group: dist.ProcessGroup, wait: timedelta, gave_up: GaveUp) -> RuntimeError:
    """The error of the ranks that waited in ``call`` when some rank did not come."""
    if gave_up.rank == dist.get_rank(group):
        head = f"global rank {dist.get_rank()} called {call} and waited {wait}"
    else:
        head = (
            f"global rank {dist.get_rank()} called {call}; global rank "
            f"{global_rank(group, gave_up.rank)} waited "
            f"{timedelta(seconds=gave_up.waited_s)} in it too and gave up"
        )
    return RuntimeError(
        f"{head} for the other ranks of the optimizer's group (global ranks "
        f"{dist.get_process_group_ranks(group)}) to call it too, but global rank(s) "
        f"{_ranks_text(group, gave_up.missing)} did not: it is a collective, every rank must call "
        f"{call} at the same point (e.g. save on every rank, not under `if rank == 0`). Nothing "
        f"of it is left pending (the agreement runs on the c10d store): this process can exit, "
        f"and the optimizer's process group is still usable. A rank that reaches a collective "
        f"ShardedOptimizer call later raises at once, naming this one; a rank waiting in "
        f"another collective (e.g. dist.barrier()) ends when this process exits."
    )


def _came_late(call: str, group: dist.ProcessGroup, late: GaveUp) -> RuntimeError:
    """The error of a rank that reaches ``call`` after another rank gave up waiting for it."""
    theirs = _NAMES.get(late.values[0], "an unknown call")
    who = f"global rank {global_rank(group, late.rank)}"
    waited = timedelta(seconds=late.waited_s)
    if theirs != call:
        return RuntimeError(
            f"ranks of the group are in different collective calls: {who} called {theirs} "
            f"and gave up after waiting {waited} for this rank (global rank {dist.get_rank()}), "
            f"which calls {call} instead. Every rank must make the same collective calls in "
            f"the same order; a rank-dependent branch (e.g. `if rank == 0: "
            f"optimizer.state_dict()`, a backward or no_sync() on some ranks only) is the usual "
            f"cause."
        )
    return RuntimeError(
        f"{who} called {call} and gave up after waiting {waited} for this rank (global rank "
        f"{dist.get_rank()}), which reached it only now. Every rank must reach a collective "
        f"call within collective_timeout of the others; raise collective_timeout if a rank "
        f"legitimately runs that far behind (e.g. an evaluation on one rank only)."
    )


def agree_step(
    param_groups: Sequence[dict[str, Any]],
    changed: bool,
    sparse: str | None,
    group: dist.ProcessGroup,
    timeout: timedelta | None,
) -> bool:
    """The per-step agreement; returns whether any rank saw ``requires_grad`` change.

    See [Note: Per-step agreement].

    Raises:
        ValueError: ranks have different hyper-parameters (on every rank).
        TypeError: some rank has a sparse gradient (on every rank).
        RuntimeError: the agreement did not complete within ``timeout``, or ranks are in
            different calls (see [Note: Call agreement]).
    """
    digest = hyperparam_digest(param_groups)
    same, any_changed, any_sparse = agree_call(
        STEP_CALL, group, timeout, digest=digest, changed=changed, flag=sparse is not None
    )
    if not same:
        gathered = all_gather_objects([_hyperparams(g) for g in param_groups], group)
        raise ValueError(
            "ranks step with different hyper-parameters; every rank must use the same values "
            "(a schedule computed from a per-rank quantity, e.g. each rank's own loader length, "
            f"is a common cause): {describe_difference(gathered)}"
        )
    if any_sparse:
        detail = [s for s in all_gather_objects(sparse, group) if s is not None]
        raise TypeError(detail[0])
    return bool(any_changed)


def describe_difference(gathered: list[list[dict[str, Any]]]) -> str:
    """Which group and key differ between rank 0 and the first rank that differs.

    Args:
        gathered: every rank's list of param-group hyper-parameters (:func:`hyperparams`),
            e.g. from an all-gather.
    """
    for r, groups in enumerate(gathered[1:], start=1):
        for gi, (a, b) in enumerate(zip(gathered[0], groups, strict=False)):
            for key in sorted(set(a) | set(b)):
                if repr(a.get(key)) != repr(b.get(key)):
                    return (
                        f"param group {gi} has {key}={a.get(key)!r} on rank 0 but "
                        f"{key}={b.get(key)!r} on rank {r}"
                    )
        if len(groups) != len(gathered[0]):
            return f"rank 0 has {len(gathered[0])} param groups, rank {r} has {len(groups)}"
    return "the hyper-parameters differ in their representation"


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """``p``'s sum in fp64, in chunks of :data:`_FINGERPRINT_CHUNK` elements ([Note: Param order
    fingerprint])."""
    flat = p.detach().reshape(-1)
    if flat.numel() <= _FINGERPRINT_CHUNK:
        return flat.sum(dtype=torch.float64)
    n, step = flat.numel(), _FINGERPRINT_CHUNK
    parts = [flat[i : i + step].sum(dtype=torch.float64) for i in range(0, n, step)]
    return torch.stack(parts).sum()


def check_param_order(params: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """See [Note: Param order fingerprint].

    Raises:
        ValueError: same-shaped params are passed in a different order on some rank.
    """
    global _warned_values
    if not params:
        return
    with torch.no_grad():
        values = [_fingerprint(p) for p in params]
        device = values[0].device
        sums = torch.stack([v.to(device) for v in values]).cpu().tolist()  # one sync
    key = hashlib.sha256(repr(sums).encode()).hexdigest()
    keys = all_gather_objects(key, group)
    if all(k == keys[0] for k in keys):
        return
    lists = all_gather_objects(sums, group)
    shapes = [tuple(p.shape) for p in params]
    ref = lists[0]
    for r, mine in enumerate(lists[1:], start=1):
        for i, value in enumerate(mine):
            if value == ref[i]:
                continue
            for j, other in enumerate(ref):
                if j != i and other == value and shapes[j] == shapes[i] and mine[j] == ref[i]:
                    raise ValueError(
                        f"ranks pass the params in different orders: param {i} (shape "
                        f"{shapes[i]}) on rank {r} holds the values of param {j} on rank 0, and "
                        f"the other way round. Build the param list in the same order on every "
                        f"rank (e.g. model.parameters(), not a set or a dict filled in another "
                        f"order)."
                    )
    if not _warned_values:
        _warned_values = True
        logger.warning(
            "ShardedOptimizer: param values differ between ranks at construction (not a "
            "reordering): the ranks were initialised differently; wrap the model in DDP first "
            "(it broadcasts rank 0's values) or seed every rank alike"
        )


def step_flags(
    params: Sequence[torch.Tensor],
    trainable: Sequence[bool],
    rank: int,
    error: str | None,
    repartition: bool,
) -> tuple[bool, str | None]:
    """This rank's inputs to the per-step agreement: (``repartition`` and ``requires_grad``
    changed since the layout recorded ``trainable``, this rank's reason to refuse the step:
    ``error``, else a sparse gradient). A driver (``repartition=False``) checks
    ``requires_grad`` itself."""
    changed = False
    for i, p in enumerate(params):
        g = p.grad
        if (
            error is None
            and g is not None
            and type(g) is not _ReducedGrad  # dense, and read only through its own checks
            and (g.is_sparse or g.layout != torch.strided)
        ):
            error = (
                f"param {i} (shape {tuple(p.shape)}) has a sparse gradient ({g.layout}) on "
                f"rank {rank}; ShardedOptimizer supports dense gradients only. Use "
                f"nn.Embedding(sparse=False) or keep these params in an unsharded optimizer."
            )
        changed |= repartition and p.requires_grad != trainable[i]
    return changed, error
