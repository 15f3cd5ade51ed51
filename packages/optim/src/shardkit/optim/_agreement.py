"""Agreement between the ranks of a ShardedOptimizer beyond the construction check.

[Note: Per-step agreement]
Each rank steps only its own shard with its own copy of the hyper-parameters, so a rank whose
``lr`` (or betas, weight decay, ...) differs from the others' trains its shard with it, silently
(a schedule built from each rank's own loader length is enough). And a decision one rank takes
alone before a collective (repartition because ``requires_grad`` changed on that rank, an error
about a sparse gradient) leaves the others waiting in the next collective for the process
group's timeout. So every ``step()`` starts with one all-reduce (MAX) of four int64s:
``[digest, -digest, requires_grad changed, sparse gradient seen]``, where ``digest`` is a 62-bit
hash of every param group's hyper-parameters. Unequal digests (max != -max(-d)) raise on every
rank with the differing values; a change of ``requires_grad`` on any rank repartitions on every
rank; a sparse gradient on any rank raises on every rank. With a ``collective_timeout`` the
all-reduce is waited on with that timeout, so a rank that never reaches ``step()`` makes the
others raise after it instead of hanging. The cost is one 32-byte collective per step.

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
import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._dist import _comm_device
from shardkit.optim._state import _hyperparams
from shardkit.partition import all_gather_objects

__all__: list[str] = []

logger = logging.getLogger("shardkit.optim")
_warned_values = False


def hyperparam_digest(param_groups: Sequence[dict[str, Any]]) -> int:
    """62-bit digest of every group's hyper-parameters (everything but ``params``)."""
    text = repr([sorted(_hyperparams(g).items(), key=lambda kv: kv[0]) for g in param_groups])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2


def _wait(work: dist.Work | None, timeout: timedelta | None, what: str) -> None:
    if work is None:
        return
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as e:
        raise RuntimeError(
            f"{what}: the ranks of the optimizer's group did not all take part within "
            f"{timeout} (a rank skipped the call, is stuck, or died): {e}"
        ) from e


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
        RuntimeError: the all-reduce did not complete within ``timeout``.
    """
    digest = hyperparam_digest(param_groups)
    flags = torch.tensor(
        [digest, -digest, int(changed), int(sparse is not None)],
        dtype=torch.int64,
        device=_comm_device(group),
    )
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
    _wait(work, timeout, "ShardedOptimizer.step()")
    top, low, any_changed, any_sparse = (int(v) for v in flags.tolist())
    if top != -low:
        gathered = all_gather_objects([_hyperparams(g) for g in param_groups], group)
        raise ValueError(
            "ranks step with different hyper-parameters; every rank must use the same values "
            "(a schedule computed from a per-rank quantity, e.g. each rank's own loader length, "
            f"is a common cause): {_describe_difference(gathered)}"
        )
    if any_sparse:
        detail = [s for s in all_gather_objects(sparse, group) if s is not None]
        raise TypeError(detail[0])
    return bool(any_changed)


def _describe_difference(gathered: list[list[dict[str, Any]]]) -> str:
    """Which group and key differ between rank 0 and the first rank that differs."""
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


def agree_clip(
    local: torch.Tensor, max_norm: float, norm_type: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """The total norm from every rank's partial norm, checking that every rank clips the same
    way (``max_norm``, ``norm_type``); one all-gather of three floats per rank.

    Raises:
        ValueError: ranks pass different ``max_norm`` or ``norm_type`` (on every rank).
    """
    world = dist.get_world_size(group)
    mine = torch.stack(
        [
            local.to(torch.float64),
            torch.tensor(max_norm, dtype=torch.float64, device=local.device),
            torch.tensor(norm_type, dtype=torch.float64, device=local.device),
        ]
    )
    out = torch.empty(world * 3, dtype=torch.float64, device=local.device)
    dist.all_gather_into_tensor(out, mine, group=group)
    rows = out.view(world, 3)
    settings = rows[:, 1:].tolist()
    if any(s != settings[0] for s in settings):
        raise ValueError(
            "clip_grad_norm: ranks pass different (max_norm, norm_type): "
            + ", ".join(f"rank {r}: {tuple(s)}" for r, s in enumerate(settings))
            + "; every rank must clip with the same values"
        )
    partial = rows[:, 0].to(torch.float32)
    return partial.max() if math.isinf(norm_type) else partial.sum()


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
