"""Agreement between the ranks of a ShardedOptimizer beyond the construction check.

[Note: Call agreement]
Every collective entry point of a ShardedOptimizer (``step()``, ``clip_grad_norm()``,
``consolidate_state_dict()``, ``state_dict(all_ranks=True)``, the implicit consolidation of
``state_dict()``) and of the drivers (ShardedDataParallel's backward, ``optimizer_state_dict()``,
...) starts with the same small agreement: a reduction (MAX) over the ranks of the optimizer's
group of six int64s ``[call, -call, digest, -digest, requires_grad changed, sparse gradient]``,
where ``call`` names the entry point. It runs on the c10d store the process group was built
from, never on a process group (see [Note: Agreement over the store] in ``_exchange.py``),
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
other. At construction each rank also reduces every param to one number (its sum in fp64) and
compares the list's digest across ranks; if the lists differ and some rank's list is a
permutation of rank 0's among same-shaped params, every rank raises naming the swapped params.
Lists that differ otherwise (ranks initialised with different seeds, to be synchronised by DDP's
broadcast) are not an ordering error: they are logged once.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from shardkit.checkpoint import REFUSED, Outcome, agreed_error, outcome, register_error_type
from shardkit.checkpoint import agree_outcome as _agree_outcome
from shardkit.optim._dist import global_rank
from shardkit.optim._exchange import GaveUp, exchange
from shardkit.optim._state import _hyperparams
from shardkit.partition import all_gather_objects

__all__ = [
    "agree_call",
    "agree_outcome",
    "agree_values",
    "agreed_error",
    "describe_difference",
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
"""What the c10d store raises when it fails (its wait timeouts are caught in ``_exchange``)."""


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


def check_param_order(params: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """See [Note: Param order fingerprint].

    Raises:
        ValueError: same-shaped params are passed in a different order on some rank.
    """
    global _warned_values
    if not params:
        return
    with torch.no_grad():
        values = [p.detach().sum(dtype=torch.float64) for p in params]
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
        if (
            error is None
            and p.grad is not None
            and (p.grad.is_sparse or p.grad.layout != torch.strided)
        ):
            error = (
                f"param {i} (shape {tuple(p.shape)}) has a sparse gradient ({p.grad.layout}) on "
                f"rank {rank}; ShardedOptimizer supports dense gradients only. Use "
                f"nn.Embedding(sparse=False) or keep these params in an unsharded optimizer."
            )
        changed |= repartition and p.requires_grad != trainable[i]
    return changed, error
