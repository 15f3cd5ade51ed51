"""One path between the state each rank holds and the plain full optimizer state dict.

[Note: One full state dict]
ZeRO-1 (``LocalShards``: the whole params a rank owns) and ZeRO-2 (``ShardStepper``: the whole
params of whole-param buckets, and pieces of the params of fragment buckets) build the plain
torch optimizer state dict of [Note: Optimizer state format] (in ``shardkit.optim._shard_state``)
through the same steps, here:

1. each rank describes what it holds as :class:`Holdings`: the live state of its whole params by
   global index, their masters riding in the entry (``join_wire``), and for each param it holds a
   piece of, :func:`piece_keys` of that piece's state (the dtype of each per-element value, the
   format of each compact moment, the scalars themselves);
2. one consolidation ([Note: Tensor consolidation] in ``shardkit.optim._consolidate``) moves the
   whole params' tensors to the recipient(s) without pickling them; its metadata exchange carries
   every rank's piece keys too, which :func:`merge_piece_keys` checks agree (the pieces of a param
   see the same global usage, so the same scalars and keys);
3. the pieces' per-element state is gathered by the caller's ``pieces`` (ZeRO-2's all-gathers of
   each fragment bucket: collective, on every rank);
4. :func:`plain_dict` makes ``{"state", "param_groups"}`` (plus ``"master_params"`` with masters),
   sorted by global index.

Compact moments (``compact_state``) leave as fp32 tensors (:func:`transport_state`), or as they
are held, for a checkpoint's items ([Note: Compact checkpoint items]). Loading goes the other way
through :func:`saved_state`: one validation and one mapping of the saved param ids ([Note: Saved
param ids] in ``shardkit.optim._state``) to global indices, for both.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._compact import CompactFormat, CompactTensor
from shardkit.optim._compact_optim import plain_state
from shardkit.optim._consolidate import _consolidate
from shardkit.optim._master import MASTER_KEY, check_master_values, split_wire
from shardkit.optim._state import (
    _validate_plain_state_dict,
    global_params,
    numbered_groups,
    saved_by_index,
)

__all__ = [
    "Compact",
    "Holdings",
    "PerElement",
    "Pieces",
    "Saved",
    "gather_state_dict",
    "merge_piece_keys",
    "piece_keys",
    "plain_dict",
    "saved_state",
    "to_device",
    "transport_state",
]

Pieces = Callable[[dict[int, dict[str, Any]]], tuple[dict[int, dict[str, Any]], dict[int, Any]]]
"""Gathers the per-element state of the pieces, given every param's merged piece keys; returns
``(state, masters)`` by global index. Collective."""


@dataclass(frozen=True)
class PerElement:
    """Marks a per-element state key of a piece (its dtype), in the exchanged piece keys."""

    dtype: str


@dataclass(frozen=True)
class Compact:
    """Marks a compact moment of a piece (its format), in the exchanged piece keys."""

    fmt: CompactFormat


def transport_state(state: Mapping[str, Any], compact: bool) -> dict[str, Any]:
    """One param's state as it leaves the rank: compact moments as fp32 tensors ([Note: Compact
    state under ZeRO-1]), or with ``compact`` as they are held ([Note: Compact checkpoint
    items]). Values are live (not copied)."""
    return dict(state) if compact else plain_state(state)


def piece_keys(state: Mapping[str, Any]) -> dict[str, Any]:
    """What the other ranks need to know of one piece's state: each per-element tensor's dtype,
    each compact moment's format, and (copies of) the scalar values."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, CompactTensor):
            out[k] = Compact(v.fmt)
        elif isinstance(v, torch.Tensor) and v.dim() > 0:
            out[k] = PerElement(str(v.dtype).removeprefix("torch."))
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().cpu().clone()
        else:
            out[k] = copy.deepcopy(v)
    return out


@dataclass
class Holdings:
    """What one rank holds of an optimizer's state, by global index (see [Note: One full state
    dict])."""

    whole: dict[int, dict[str, Any]]
    """The live state of each whole param held here, its master under the wire key
    (``join_wire``)."""
    pieces: dict[int, dict[str, Any]] = field(default_factory=dict)
    """:func:`piece_keys` of each param a piece of which is held here (ZeRO-2)."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and bool(torch.equal(a, b))
    return bool(type(a) is type(b) and a == b)


def _show(keys: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(keys.items()))


def merge_piece_keys(per_rank: Sequence[Mapping[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """Every param's piece keys, from every rank's (in rank order).

    Raises:
        RuntimeError: the pieces of a param disagree on its scalar state or keys (the ranks did
            not step it alike).
    """
    merged: dict[int, dict[str, Any]] = {}
    for rank, keys_of in enumerate(per_rank):
        for gi, keys in keys_of.items():
            seen = merged.setdefault(gi, keys)
            if seen.keys() != keys.keys() or not all(_same(seen[k], keys[k]) for k in keys):
                raise RuntimeError(
                    f"the pieces of param {gi} hold different optimizer "
                    f"state on rank {rank} ({_show(keys)}) and on a lower rank ({_show(seen)}); "
                    f"the ranks did not step it alike"
                )
    return merged


def plain_dict(
    state: Mapping[int, dict[str, Any]],
    masters: Mapping[int, torch.Tensor],
    param_groups: Sequence[Mapping[str, Any]],
    with_masters: bool,
) -> dict[str, Any]:
    """``{"state", "param_groups"}`` (plus ``"master_params"`` when ``with_masters``), by global
    index: [Note: Optimizer state format]."""
    out: dict[str, Any] = {
        "state": dict(sorted(state.items())),
        "param_groups": numbered_groups(param_groups),
    }
    if with_masters:
        out[MASTER_KEY] = dict(sorted(masters.items()))
    return out


def _cpu_compact(entry: Mapping[str, Any]) -> dict[str, Any]:
    """Compact moments travel as objects (with the metadata): on the CPU, as copies."""
    return {
        k: CompactTensor(v.codes.cpu().clone(), v.scales.cpu().clone(), v.shape, v.fmt)
        if isinstance(v, CompactTensor)
        else v
        for k, v in entry.items()
    }


def to_device(v: Any, device: torch.device) -> Any:
    """``v`` on ``device`` if it is a per-element tensor (scalars stay where they are)."""
    return v.to(device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v


def gather_state_dict(
    held: Holdings,
    param_groups: Sequence[Mapping[str, Any]],
    group: dist.ProcessGroup,
    recipient: int,
    *,
    with_masters: bool,
    skipped: Set[int] = frozenset(),
    pieces: Pieces | None = None,
    device: torch.device | None = None,
    under: tuple[Mapping[int, dict[str, Any]], Mapping[int, torch.Tensor]] | None = None,
) -> dict[str, Any] | None:
    """The plain full state dict on ``recipient`` (-1: every rank), ``None`` elsewhere.
    Collective over ``group``; see [Note: One full state dict].

    Args:
        held: What this rank holds.
        param_groups: The optimizer's param groups (global indices, hyper-parameters).
        group: The optimizer's process group.
        recipient: The group rank that gets the dict, -1 for every rank (needed with ``pieces``).
        with_masters: Whether the dict has ``"master_params"``.
        skipped: Global indices held here whose tensors stay here (``meta`` on the recipient).
        pieces: Gathers the pieces' per-element state (see :data:`Pieces`).
        device: Where the whole params' tensors go (the CPU, as consolidated, when ``None``).
        under: State and masters of params nobody holds (ZeRO-2's parked state), taken where
            no rank holds the param.

    Raises:
        RuntimeError: the pieces of a param disagree (see :func:`merge_piece_keys`).
        ValueError: ranks passed different recipients.
    """
    if pieces is not None and recipient != -1:
        raise ValueError(f"pieces of params are gathered on every rank, not onto {recipient}")
    whole = {gi: _cpu_compact(entry) for gi, entry in held.whole.items()}
    full, extras = _consolidate(
        whole, group, dist.get_rank(group), recipient, set(skipped), extra=held.pieces
    )
    if full is None:
        return None
    whole_state, whole_masters = split_wire(full)
    state: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    if pieces is not None:
        state, masters = pieces(merge_piece_keys(extras))
    if device is not None:
        whole_state = {
            gi: {k: to_device(v, device) for k, v in st.items()} for gi, st in whole_state.items()
        }
        whole_masters = {gi: m.to(device) for gi, m in whole_masters.items()}
    state.update(whole_state)
    masters.update(whole_masters)
    if under is not None:
        state = {**copy.deepcopy(dict(under[0])), **state}
        masters = {**{gi: m.clone() for gi, m in under[1].items()}, **masters}
    return plain_dict(state, masters, param_groups, with_masters)


@dataclass
class Saved:
    """A validated plain state dict, by global index."""

    state: dict[int, dict[str, Any]]
    """Global index -> the param's saved state."""
    masters: dict[int, torch.Tensor]
    """Global index -> the param's saved master (``"master_params"``)."""
    groups: list[dict[str, Any]]
    """The saved param groups (hyper-parameters)."""


def saved_state(
    state_dict: Any,
    param_groups: Sequence[Mapping[str, Any]],
    not_a_dict: type[Exception] = TypeError,
) -> Saved:
    """Validates a plain torch optimizer state dict against ``param_groups`` and keys its state
    and masters by global index ([Note: Saved param ids] in ``shardkit.optim._state``).

    Args:
        state_dict: The dict (``ShardedOptimizer.state_dict()``, :func:`gather_full_state_dict`,
            a plain torch optimizer's, or torch.distributed.checkpoint's, with param names).
        param_groups: The optimizer's param groups.
        not_a_dict: The error type raised when ``state_dict`` is not a dict.

    Raises:
        TypeError, ValueError: see ``_validate_plain_state_dict`` and ``check_master_values``;
            nothing is changed then.
    """
    if not isinstance(state_dict, Mapping) and not_a_dict is not TypeError:
        raise not_a_dict(
            f"load_state_dict expects a plain torch optimizer state dict with 'state' and "
            f"'param_groups' keys, got {type(state_dict).__name__}"
        )
    _validate_plain_state_dict(state_dict, param_groups)
    state = saved_by_index(state_dict)
    masters: dict[int, torch.Tensor] = {}
    if MASTER_KEY in state_dict:
        masters = check_master_values(state_dict[MASTER_KEY], global_params(param_groups))
    return Saved(state, masters, list(state_dict["param_groups"]))
