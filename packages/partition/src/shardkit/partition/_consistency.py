"""Cross-rank agreement check: :func:`check_consistent`."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from shardkit.partition._objects import all_gather_objects, comm_device
from shardkit.partition._partition import Partition
from shardkit.partition._spec import ParamSpec, _as_specs
from torch.distributed import ProcessGroup

__all__ = ["check_consistent"]

_Entry = tuple[Any, ...]


def _fingerprint(obj: object) -> tuple[_Entry, list[_Entry]]:
    """(header, one entry per parameter). Raises TypeError/ValueError on bad local input."""
    if isinstance(obj, Partition):
        if not obj.specs:
            raise ValueError(
                "check_consistent: this Partition records no parameter specs; build it with "
                "partition(...) or pass the parameters instead"
            )
        header: _Entry = ("partition", obj.algorithm, obj.world_size)
        entries = [
            (*_entry(s), f"owned by rank {r}")
            for s, r in zip(obj.specs, obj.assignment, strict=True)
        ]
        return header, entries
    specs = _as_specs(obj, "check_consistent")  # type: ignore[arg-type]
    return ("params",), [_entry(s) for s in specs]


def _entry(s: ParamSpec) -> _Entry:
    return (s.shape, str(s.dtype).replace("torch.", ""), "trainable" if s.requires_grad else "frozen")


def _digest(header: _Entry, entries: Sequence[_Entry]) -> bytes:
    h = hashlib.sha256(repr(header).encode())
    h.update(repr(len(entries)).encode())
    for e in entries:
        h.update(repr(e).encode())
    return h.digest()


def _wait(work: Any, timeout: timedelta | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def check_consistent(
    params_or_partition: Iterable[torch.Tensor | ParamSpec] | Partition,
    group: ProcessGroup | None = None,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Check that every rank of ``group`` partitions the same parameters the same way.

    Collective: every rank of ``group`` must call it. Each rank fingerprints its input
    (parameter count, and per parameter in order: shape, dtype, trainability, plus the owning
    rank for a :class:`Partition`), the 32-byte digests are all-gathered, and only if they
    differ are the full fingerprints gathered to explain the difference.

    # [Note: Raise everywhere]
    # Every rank takes part in the same collectives whatever its input: a rank whose input is
    # invalid gathers a marker instead of a digest, and every decision after a collective is
    # computed from gathered data only. So either all ranks return or all ranks raise (a
    # ValueError naming the first differing parameter index and which ranks hold what),
    # and no rank is left waiting in a collective the others skipped.

    Args:
        params_or_partition: Tensors / :class:`ParamSpec` in this rank's order, or a
            :class:`Partition` computed on this rank.
        group: Process group (default: the default group).
        timeout: Give up waiting for the other ranks after this long (e.g. a rank never
            calls ``check_consistent``); default: the group's own timeout. On Gloo the
            all-gather given up on stays pending (Gloo cannot drop it): the process cannot
            exit before the other ranks' processes have, so use it where the whole job ends
            on the error.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: on every rank, when any rank differs or any rank's input is invalid.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "check_consistent needs torch.distributed initialised; call "
            "dist.init_process_group(...) first (it is a collective over the group)"
        )
    local_error: str | None = None
    header: _Entry = ()
    entries: list[_Entry] = []
    try:
        header, entries = _fingerprint(params_or_partition)
        if isinstance(params_or_partition, Partition):
            size = dist.get_world_size(group)
            if params_or_partition.world_size != size:
                header = (*header, f"world_size {params_or_partition.world_size} != group size {size}")
                raise ValueError(
                    f"check_consistent: the partition is for world_size "
                    f"{params_or_partition.world_size} but the group has {size} ranks; "
                    f"partition with world_size=dist.get_world_size(group)"
                )
        digest = _digest(header, entries)
    except (TypeError, ValueError) as exc:
        local_error = f"{type(exc).__name__}: {exc}"
        digest = bytes(32)  # marker; never a sha256 of real input in practice
    world = dist.get_world_size(group)
    device = comm_device(group)
    mine = torch.tensor([*digest, 1 if local_error else 0], dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    _wait(dist.all_gather(gathered, mine, group=group, async_op=True), timeout)
    rows = [bytes(t.cpu().tolist()) for t in gathered]
    if all(r == rows[0] for r in rows) and rows[0][-1] == 0:
        return
    # Mismatch or error somewhere: every rank saw it, every rank gathers the details.
    details = all_gather_objects((local_error, header, entries), group)  # See [Note: Object collectives without NumPy]
    raise ValueError(_explain(details, group))


def _rank_name(r: int, group: ProcessGroup | None) -> str:
    if group is None or group == dist.GroupMember.WORLD:
        return str(r)
    return f"{r} (global {dist.get_global_rank(group, r)})"


def _ranks(rs: Sequence[int], group: ProcessGroup | None) -> str:
    """``rank 1 has`` / ``ranks 0, 2 have``."""
    names = [_rank_name(r, group) for r in rs]
    if len(names) == 1:
        return f"rank {names[0]} has"
    return "ranks " + ", ".join(names) + " have"


def _explain(details: Sequence[Any], group: ProcessGroup | None) -> str:
    errors = [(r, d[0]) for r, d in enumerate(details) if d[0] is not None]
    if errors:
        text = "; ".join(f"rank {_rank_name(r, group)}: {e}" for r, e in errors)
        return f"check_consistent: invalid input on {len(errors)} rank(s): {text}"
    headers = [d[1] for d in details]
    if any(h != headers[0] for h in headers):
        groups = _group_by([repr(h) for h in headers])
        text = "; ".join(f"{_ranks(rs, group)} {v}" for v, rs in groups)
        return f"check_consistent: ranks disagree on the partition itself: {text}"
    lists = [d[2] for d in details]
    counts = [len(x) for x in lists]
    longest = max(counts)
    for i in range(longest):
        values = [repr(x[i]) if i < len(x) else "<missing>" for x in lists]
        if all(v == values[0] for v in values):
            continue
        groups = _group_by(values)
        text = "; ".join(f"{_ranks(rs, group)} {v}" for v, rs in groups)
        count_note = ""
        if any(c != counts[0] for c in counts):
            cgroups = _group_by([str(c) for c in counts])
            count_note = " Parameter counts differ: " + "; ".join(
                f"{_ranks(rs, group)} {c}" for c, rs in cgroups
            ) + "."
        return (
            f"check_consistent: parameters differ across ranks, first at index {i}: {text}."
            f"{count_note} Every rank must pass the same parameters in the same order "
            f"(build the model identically on every rank, and never collect parameters "
            f"through a set or an unordered dict)"
        )
    return "check_consistent: ranks disagree (digest mismatch without a visible difference)"


def _group_by(values: Sequence[str]) -> list[tuple[str, list[int]]]:
    out: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return list(out.items())
