"""Optimizer state dicts of a :class:`~shardkit.optim.ShardStepper`: plain torch format, both ways.

[Note: Optimizer state format]
``full_state_dict`` returns, on every rank, what a plain optimizer of the same class stepping
every param would hold: ``{"state": {global index: {...}}, "param_groups": [...]}`` with global
indices over the sharded optimizer's param groups flattened, plus shardkit-optim's
``"master_params"`` (global index -> master tensor) when ``master_dtype`` is set. That is the
format of ``ShardedOptimizer.state_dict()`` after consolidation, so either loads the other's
dicts, and so does a plain torch optimizer (extra keys are ignored).

Fragment buckets hold one local tensor per param piece ([Note: Per-param fragments] in
``shardkit.optim._shard_stepper``). Their per-element state (a tensor of one or more dims, shaped like
the piece) is written into a zero buffer of the rank's range, all-gathered into the bucket's
layout and cut per param; their scalar state (``step``, ASGD's ``eta`` / ``mu``) and which
keys each param has travel as objects, and the pieces of one param must agree on them (they
do: the ranks see the same global usage). Whole-param state is consolidated from its owner as
ZeRO-1's is: both take the one path of [Note: One full state dict] in ``_full_state.py``.
Loading cuts each piece out of the per-param tensors and copies the param's scalars; it is not
collective.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim._compact import CompactFormat, CompactTensor
from shardkit.optim._compact_optim import quantize_state
from shardkit.optim._dist import AllGather
from shardkit.optim._flat import FlatBucket
from shardkit.optim._full_state import (
    Compact,
    Holdings,
    PerElement,
    gather_state_dict,
    piece_keys,
    saved_state,
    to_device,
    transport_state,
)
from shardkit.optim._master import MASTER_KEY, join_wire
from shardkit.optim._shard_stepper import ShardEntry, ShardStepper
from shardkit.optim._state import _hyperparams as hyperparams
from shardkit.optim._state import global_index, global_params
from shardkit.optim._torch_compat import all_gather_single

__all__ = [
    "ParkedState",
    "checkpoint_part",
    "gather_full_state_dict",
    "load_full_state_dict",
]


def _default_all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> object:
    return all_gather_single(out, inp, group=group)


@dataclass
class ParkedState:
    """Optimizer state of params that are not trainable now (not in the bucket layout), kept
    whole on every rank until they train again, as a plain optimizer keeps it (shardkit-ddp's
    [Note: Trainable refresh])."""

    state: dict[int, dict[str, Any]]
    """Global index -> the param's saved state."""
    masters: dict[int, torch.Tensor]
    """Global index -> the param's saved master (with ``master_dtype``)."""

    def nbytes(self) -> int:
        """Bytes of the parked tensors."""
        tensors = [v for st in self.state.values() for v in st.values()]
        tensors += list(self.masters.values())
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def gather_full_state_dict(
    stepper: ShardStepper,
    buckets: Sequence[FlatBucket],
    param_groups: Sequence[dict[str, Any]],
    group: dist.ProcessGroup,
    *,
    parked: ParkedState | None = None,
    all_gather: AllGather | None = None,
    compact: bool = False,
) -> dict[str, Any]:
    """The plain-torch optimizer state dict, on every rank. Collective over ``group``.

    See [Note: Optimizer state format], and [Note: One full state dict] for the path it takes
    (ZeRO-1's consolidation's). Compact moments (``compact_state``) are dequantized to fp32
    tensors, or with ``compact`` gathered as they are (codes and scales) into ``CompactTensor``
    values, for a checkpoint ([Note: Compact checkpoint items] in ``shardkit.optim._checkpoint``).

    Args:
        stepper: This rank's stepper over ``buckets``.
        buckets: The flat buckets of the optimizer (the same on every rank).
        param_groups: The sharded optimizer's param groups (global indices, hyper-parameters).
        group: The buckets' process group.
        parked: The state of params outside the layout, included whole.
        all_gather: The all-gather to use (see :data:`AllGather`).
        compact: Keep compact moments compact (see above).

    Raises:
        RuntimeError: the pieces of a param disagree on its scalar state or keys (the ranks
            did not step alike).
    """
    index = global_index(param_groups)
    local = stepper.local
    whole: dict[int, dict[str, Any]] = {}
    pieces: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    for e in stepper.all_entries():
        gi = index[id(e.param)]
        st = transport_state(local.state.get(e.opt, {}) if local is not None else {}, compact)
        if e.fragment:
            if st:
                pieces[gi] = piece_keys(st)
            continue
        if st:
            whole[gi] = st
        if e.master is not None:
            masters[gi] = e.master_value().detach()
    comm = (dist.get_world_size(group), group, all_gather or _default_all_gather)

    def gather_pieces(
        merged: dict[int, dict[str, Any]],
    ) -> tuple[dict[int, dict[str, Any]], dict[int, torch.Tensor]]:
        state: dict[int, dict[str, Any]] = {}
        fragment_masters: dict[int, torch.Tensor] = {}
        for b in buckets:
            if b.elementwise:
                _gather_fragments(stepper, b, index, merged, comm, state, fragment_masters, compact)
        return state, fragment_masters

    under = None
    if parked is not None:  # a format-3 load may have parked compact moments
        kept = {gi: transport_state(st, compact) for gi, st in parked.state.items()}
        under = (kept, parked.masters)
    out = gather_state_dict(
        Holdings(join_wire(whole, masters), pieces),
        param_groups,
        group,
        -1,
        with_masters=stepper.master_dtype is not None,
        pieces=gather_pieces,
        device=buckets[0].device if buckets else torch.device("cpu"),
        under=under,
    )
    assert out is not None  # every rank receives it (recipient -1)
    return out


def _gather_fragments(
    stepper: ShardStepper,
    b: FlatBucket,
    index: dict[int, int],
    merged: dict[int, dict[str, Any]],
    comm: tuple[int, dist.ProcessGroup, AllGather],
    state: dict[int, dict[str, Any]],
    masters: dict[int, torch.Tensor],
    compact: bool = False,
) -> None:
    """Fills ``state`` / ``masters`` with the full state of fragment bucket ``b``'s params:
    one all-gather per per-element key (and one of the masters; with ``compact``, two more per
    key with compact moments: codes and scales). Collective; every rank takes the same keys
    from ``merged``."""
    local = stepper.local
    world, group, gather = comm
    mine = [e for e in stepper.all_entries() if e.bucket is b]
    gis = [index[id(p)] for p in b.params]
    dtypes: dict[str, str] = {}
    formats: dict[str, CompactFormat] = {}
    for gi in gis:
        for k, v in merged.get(gi, {}).items():
            if isinstance(v, PerElement):
                dtypes.setdefault(k, v.dtype)
            elif isinstance(v, Compact) and formats.setdefault(k, v.fmt) != v.fmt:
                raise RuntimeError(f"the params of bucket {b.index} hold {k!r} in two formats")
    for gi in gis:
        if gi in merged:
            state[gi] = {k: to_device(v, b.device) for k, v in merged[gi].items()}
    for k, fmt in sorted(formats.items(), key=lambda kv: kv[0]):
        _gather_compact(b, mine, local, k, fmt, gis, merged, comm, state)
    for k, dtype in sorted(dtypes.items()):
        buf = torch.zeros(b.shard, dtype=getattr(torch, dtype), device=b.device)
        for e in mine:
            v = local.state.get(e.opt, {}).get(k) if local is not None else None
            if isinstance(v, CompactTensor):
                if compact:
                    continue  # gathered as codes and scales
                v = v.dequantize()
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.numel() != e.tensor.numel():
                    raise RuntimeError(
                        f"state {k!r} of param {index[id(e.param)]} has "
                        f"{v.numel()} elements, its piece on this rank {e.tensor.numel()}"
                    )
                buf[e.start : e.start + v.numel()].copy_(v.reshape(-1))
        full = _gather(buf, world, group, gather)
        for p, off, gi in zip(b.params, b.offsets, gis, strict=True):
            if isinstance(merged.get(gi, {}).get(k), PerElement):
                state[gi][k] = full[off : off + p.numel()].view(p.shape).clone()
    if stepper.has_master(b):
        buf = torch.zeros(b.shard, dtype=stepper.master_dtype, device=b.device)
        for e in mine:
            if e.master is not None:
                buf[e.start : e.start + e.tensor.numel()].copy_(e.master_value().reshape(-1))
        full = _gather(buf, world, group, gather)
        for p, off, gi in zip(b.params, b.offsets, gis, strict=True):
            masters[gi] = full[off : off + p.numel()].view(p.shape).clone()


def _gather_compact(
    b: FlatBucket,
    mine: list[ShardEntry],
    local: Any,
    k: str,
    fmt: CompactFormat,
    gis: list[int],
    merged: dict[int, dict[str, Any]],
    comm: tuple[int, dist.ProcessGroup, AllGather],
    state: dict[int, dict[str, Any]],
) -> None:
    """The compact moment ``k`` of bucket ``b``'s compact params, gathered as codes and scales.

    Every piece starts at a multiple of the block in the rank's range, whose size is one too
    ([Note: Block-aligned fragment buckets] in ``shardkit.optim._flat``), so its code bytes and
    scales sit at fixed offsets of per-rank buffers: one all-gather of each rebuilds every
    param's, bit for bit."""
    world, group, gather = comm
    bits, block = fmt.bits, fmt.block
    if b.shard % block:
        raise RuntimeError(f"bucket {b.index} is not block-aligned for compact state {k!r}")
    codes = torch.zeros(b.shard * bits // 8, dtype=torch.uint8, device=b.device)
    scales = torch.zeros(b.shard // block, dtype=torch.float32, device=b.device)
    for e in mine:
        v = local.state.get(e.opt, {}).get(k) if local is not None else None
        if isinstance(v, CompactTensor):
            c0, s0 = e.start * bits // 8, e.start // block
            codes[c0 : c0 + v.codes.numel()].copy_(v.codes)
            scales[s0 : s0 + v.scales.numel()].copy_(v.scales)
    all_codes = _gather(codes, world, group, gather)
    all_scales = _gather(scales, world, group, gather)
    for p, off, gi in zip(b.params, b.offsets, gis, strict=True):
        if isinstance(merged.get(gi, {}).get(k), Compact):
            n = p.numel()
            c0, s0 = off * bits // 8, off // block
            state[gi][k] = CompactTensor(
                all_codes[c0 : c0 + -(-n * bits // 8)].clone(),
                all_scales[s0 : s0 + -(-n // block)].clone(),
                tuple(p.shape),
                fmt,
            )


def _gather(
    t: torch.Tensor, world: int, group: dist.ProcessGroup, gather: AllGather
) -> torch.Tensor:
    out = torch.empty(t.numel() * world, dtype=t.dtype, device=t.device)
    gather(out, t.detach().contiguous(), group)
    return out


def load_full_state_dict(
    stepper: ShardStepper,
    buckets: Sequence[FlatBucket],
    param_groups: list[dict[str, Any]],
    state_dict: dict[str, Any],
) -> ParkedState:
    """Loads a plain-torch optimizer state dict into this rank's shards (not collective).

    Args:
        stepper: This rank's stepper over ``buckets``.
        buckets: The flat buckets of the optimizer.
        param_groups: The sharded optimizer's param groups; their hyper-parameters are set
            from the dict.
        state_dict: A full state dict (:func:`gather_full_state_dict`, a consolidated
            ``ShardedOptimizer`` or a plain torch optimizer).

    Returns:
        The state of the params outside the bucket layout (not trainable now), to keep.

    Raises:
        ValueError: the dict does not match the params (group count/sizes, shapes, masters);
            nothing is changed then. ``TypeError`` for a ``"master_params"`` that is not a
            dict of floating tensors.
    """
    # One validation and one mapping of the saved ids, ZeRO-1's: [Note: One full state dict]
    saved = saved_state(state_dict, param_groups, not_a_dict=ValueError)
    index = global_index(param_groups)
    new: list[tuple[ShardEntry, dict[str, Any], torch.Tensor | None]] = []
    for e in stepper.all_entries():  # every piece checked before anything changes
        gi = index[id(e.param)]
        entry = saved.state.get(gi, {})
        if not isinstance(entry, dict):
            raise ValueError(f"state of param {gi} is {type(entry).__name__}, expected a dict")
        master = saved.masters.get(gi)
        new.append((e, {k: _piece(e, gi, k, v) for k, v in entry.items()}, master))
    for g, sg in zip(param_groups, saved.groups, strict=True):
        g.update(copy.deepcopy(hyperparams(sg)))
    local = stepper.local  # its groups are views of param_groups: see [Note: One owner of
    # hyper-parameters] in shardkit.optim._state
    for e, st, master in new:
        if local is not None:
            local.state[e.opt] = st
        _load_master(e, master)
    if local is not None:
        quantize_state(local)  # exact: [Note: Block-aligned fragment buckets] in _flat
    stepper.mark_masters_current()
    laid = {id(p) for b in buckets for p in b.params}
    params = global_params(param_groups)
    return ParkedState(
        {gi: copy.deepcopy(st) for gi, st in saved.state.items() if id(params[gi]) not in laid},
        {gi: m.detach().clone() for gi, m in saved.masters.items() if id(params[gi]) not in laid},
    )


def _piece(e: ShardEntry, gi: int, key: str, v: Any) -> Any:
    """Entry ``e``'s part of a param's saved state value (see [Note: Optimizer state
    format])."""
    if isinstance(v, CompactTensor):  # a format-3 checkpoint's: [Note: Compact checkpoint items]
        if v.numel != e.param.numel():
            raise ValueError(
                f"compact state of param {gi} key {key!r} holds {v.numel} elements but the "
                f"param has {e.param.numel()}: the state dict was saved for another model"
            )
        if not e.fragment:
            return v.clone()
        lo, hi = e.lo, e.lo + e.tensor.numel()
        if lo % v.fmt.block == 0 and (hi % v.fmt.block == 0 or hi == v.numel):
            return v.narrow(lo, hi).clone()  # the piece's bytes, exactly
        return v.dequantize().reshape(-1)[lo:hi].clone()  # quantized again by the load
    if not e.fragment or not isinstance(v, torch.Tensor) or v.dim() == 0:
        return _like(v, e.opt, key)
    p = e.param
    if v.numel() != p.numel():
        raise ValueError(
            f"state of param {gi} key {key!r} has shape {tuple(v.shape)} but the param has shape "
            f"{tuple(p.shape)}: the state dict was saved for another model"
        )
    return _like(v.reshape(-1)[e.lo : e.lo + e.tensor.numel()], e.opt, key)


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) else v


def _like(v: Any, t: torch.Tensor, key: str) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    if key == "step" or not v.is_floating_point():
        return v.clone()
    return v.to(device=t.device, dtype=t.dtype).clone()


def _load_master(e: ShardEntry, saved: torch.Tensor | None) -> None:
    """Master values from the dict, or from the live (just loaded model) values."""
    if e.master is None:
        return
    if saved is None:
        e.set_master(None)
        return
    e.set_master(saved.reshape(-1)[e.lo : e.lo + e.tensor.numel()])


# [Note: DCP sharded checkpoints]
# ``save_sharded`` writes ``optimizer.local_state_dict()`` of every rank (per rank disjoint
# global indices, plain per-param state) and ``load_sharded`` reads the indices the optimizer
# names for this rank, then calls ``optimizer.load_state_dict``. Under a ZeRO-2 driver a
# param's state is split at element ranges across ranks, so the optimizer's ``ShardOwner``
# (shardkit-ddp's unit) answers both:
#
# - ``checkpoint_state_dict`` is ``checkpoint_part`` of the full state dict (collective:
#   ``save_sharded`` calls it once on every rank at the same point): rank ``r`` writes the
#   whole-param state of the indices ``i % N == r``, so the checkpoint is the plain format
#   ``load_sharded`` of any ShardedOptimizer reads, at any world size;
# - ``checkpoint_indices`` names every param on every rank (each rank steps a range of every
#   element-wise bucket), so ``load_sharded`` reads the full state on every rank and hands it
#   to ``load_full_state_dict``, which cuts this rank's ranges (not collective).
#
# The cost: every rank reads the whole optimizer state at load time (as ``load_state_dict``
# of a consolidated dict does).
def checkpoint_part(full: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's part of a full state dict for ``save_sharded`` (indices ``i % world ==
    rank``, so every index is written by exactly one rank); see [Note: DCP sharded
    checkpoints]."""
    out: dict[str, Any] = {
        "state": {i: st for i, st in full["state"].items() if i % world == rank},
        "param_groups": full["param_groups"],
    }
    if MASTER_KEY in full:
        out[MASTER_KEY] = {i: m for i, m in full[MASTER_KEY].items() if i % world == rank}
    return out
